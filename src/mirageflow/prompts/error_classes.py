"""Row error classes added by issue 22 (hardening), in one place until the state contract's
enum of row error classes takes them over. Each is a row's error (errors.jsonl, status.json
``rows_failed_by_class``), never a shard failure."""

# a render ran past its time limit (mirageflow.prompts.render_bounds)
TEMPLATE_TIMEOUT = "template_timeout"
# a render would make, or made, more than its size limits allow (render_bounds)
TEMPLATE_TOO_LARGE = "template_too_large"
# an image path that leads outside the dataset's image_base_path (mirageflow.prompts.images)
IMAGE_OUTSIDE_BASE = "image_outside_base"

# Classes the same config and data give again (a retry reproduces them)
DETERMINISTIC = frozenset({TEMPLATE_TIMEOUT, TEMPLATE_TOO_LARGE, IMAGE_OUTSIDE_BASE})
