"""A row's way to the engine and back: extraction, templates, images, samples, Python steps, JSON outputs."""
