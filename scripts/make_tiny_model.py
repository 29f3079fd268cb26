"""Build the tiny random test model: python scripts/make_tiny_model.py OUT_DIR"""

import sys
from pathlib import Path

try:
    from mirageflow.model_prep import build_tiny_llama
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from mirageflow.model_prep import build_tiny_llama

print(build_tiny_llama(Path(sys.argv[1])))
