"""Regenerate tests/fakes/sglang_facts.json from the installed sglang (the real package).

    build/venv-sglang/bin/python tests/fakes/make_sglang_facts.py > tests/fakes/sglang_facts.json

The fakes read the file (the launcher's flags, the sampling parameter names);
tests/test_real_sglang.py checks that it still matches the installed package.
"""

from __future__ import annotations

import json


def facts() -> dict:
    import argparse
    import re

    import sglang
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flags.append({"flags": list(action.option_strings), "dest": action.dest, "nargs": action.nargs})
    contract = generate_contract_error({"text": "x", "sampling_params": {"__unknown__": 1}})
    return {
        "sglang": sglang.__version__,
        "server_flags": flags,
        # SamplingParams(**params), a msgspec Struct: the offline engine raises TypeError for anything else
        "sampling_params": sorted(SamplingParams.__struct_fields__),
        # POST /generate's contract gate (srt/entrypoints/api_contract.py): anything else is a 400
        "generate_sampling_params": sorted(re.findall(r"`(\w+)`", contract.split("expected", 1)[1])),
        "generate_unknown_sampling_error": contract.replace("__unknown__", "{name}"),
    }


if __name__ == "__main__":
    print(json.dumps(facts(), indent=1))
