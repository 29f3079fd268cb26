"""The slow part of the stand-in (see __init__.py): announces itself, then takes its time."""

import os
import time

with open(os.environ["SLOW_TRANSFORMERS_IMPORTING"], "w") as marker:
    marker.write(str(os.getpid()))
time.sleep(300)  # a stop signal is expected long before


class AutoModelForCausalLM:  # never reached: the import is stopped first
    pass


AutoTokenizer = AutoModelForCausalLM
