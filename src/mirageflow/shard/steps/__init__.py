"""The steps of the row path, one per output, all of one shape (``base.Step``): ``llm`` (an
LLM's answer), ``python`` (filters, custom Python functions and their worker pools),
``image`` (image_gen outputs written to files). The row path (shard/rows.py) reads only
what ``base.Step`` declares; ``python.make_step`` builds an output's step."""
