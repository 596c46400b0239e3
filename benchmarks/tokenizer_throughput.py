"""How fast a byte-level BPE tokenizer (the kind Qwen3 and GLM-4.6 ship) encodes a long prompt and
decodes output tokens on this CPU: the GPU presets' per-prompt-token and per-output-token frontend cost.

The models' own tokenizers are not on this machine, so it trains one offline (HF `tokenizers`,
a byte-level BPE with a GPT-2/Qwen-style split) on the project's own docs and code, then times
encoding one agent-sized prompt at a time (as vLLM's API server does) and decoding the answer
one token at a time (vLLM's incremental detokenizer decodes each new token with a short window).

Run with the engine virtualenv's interpreter, which has `tokenizers`:
    ~/.cache/thunderctl/engine-venv/bin/python benchmarks/tokenizer_throughput.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
DETOKENIZE_WINDOW = 6  # tokens of context decoded with each new one (vLLM's prefix offset is ~5)


def corpus() -> list[str]:
    paths = sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("thunderctl/**/*.py")])
    return [path.read_text(errors="replace") for path in paths]


def train(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=100_000, help="length of the prompt encoded")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab-size", type=int, default=32_000)
    args = parser.parse_args()
    texts = corpus()
    tokenizer = train(texts, args.vocab_size)
    text = "\n".join(texts)
    while len(tokenizer.encode(text).ids) < args.prompt_tokens:
        text += text
    ids = tokenizer.encode(text).ids[: args.prompt_tokens]
    prompt = tokenizer.decode(ids)
    encode_s = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        n = len(tokenizer.encode(prompt).ids)
        encode_s.append((time.perf_counter() - start) / n)
    answer = ids[:2000]
    decode_s = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for i in range(1, len(answer)):
            tokenizer.decode(answer[max(0, i - DETOKENIZE_WINDOW) : i + 1])
        decode_s.append((time.perf_counter() - start) / (len(answer) - 1))
    print(json.dumps({
        "tokenizer": f"byte-level BPE, {tokenizer.get_vocab_size()} tokens, trained here",
        "prompt_tokens": len(ids),
        "encode_s_per_token": statistics.median(encode_s),
        "decode_s_per_token": statistics.median(decode_s),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
