"""Small GSM8K-format word problems (`python -m molt_envs.word_problems OUT.jsonl --rows 2000`), and the text the
tiny-chat preset's tokenizer was trained on."""
import argparse
import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from .builtin import calculator, calculator_question

# Qwen2's pre-tokenizer: words, single digits, punctuation runs, whitespace.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")


NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivy", "Jon")
THINGS = ("apples", "pens", "books", "coins", "cards", "shells", "stickers", "marbles")
PROBLEMS = (("{n} has {a} {t}. {n} gets {b} more. How many {t} does {n} have now?", "+"),
            ("{n} has {a} {t} and gives away {b}. How many {t} are left?", "-"),
            ("{n} buys {a} bags with {b} {t} in each. How many {t} are there?", "*"))


def word_problem(rng: random.Random) -> dict:
    """One-step arithmetic on single digits, with GSM8K's answer format: working, then `#### N`."""
    text, op = rng.choice(PROBLEMS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if op == "-":
        a, b = max(a, b), min(a, b)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": text.format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b),
            "answer": f"{a} {op} {b} = {value}\n#### {value}"}


def word_problems(rows: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [word_problem(rng) for _ in range(rows)]


def chat_corpus():
    """Text the tiny-chat tokenizer learns its merges from: the chat template's frame around the built-in chat envs'
    conversations (a calculator tool call and its result, word problems). molt_engine/chat_tokenizer.json is the
    tokenizer trained on it: `python -m molt_envs.word_problems --tokenizer molt_engine/chat_tokenizer.json`."""
    tools = f"<|im_start|>system\n# Tools\ncalculator(expression): {calculator.__doc__.splitlines()[0]}\n<|im_end|>\n"
    rng = random.Random(0)
    for _ in range(3000):
        a, op, b, value = calculator_question(rng)
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}})
        yield (f"{tools}<|im_start|>user\nWhat is {a}{op}{b}?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{call}\n"
               f"</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{value}\n</tool_response><|im_end|>\n"
               f"<|im_start|>assistant\n{value}<|im_end|>\n")
        row = word_problem(rng)
        yield f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n{row['answer']}<|im_end|>\n"


def train_chat_bpe(corpus) -> str:
    """The tiny-chat preset's byte-level BPE (1,024 entries, the chat template's special tokens) trained on `corpus`,
    as JSON. The corpus and the trainer are deterministic: the same file on every machine."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>"]
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write a GSM8K-format JSONL file of one-step word problems, or the "
                                     "tiny-chat tokenizer trained on chat_corpus().")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", metavar="PATH", help="write the tokenizer (JSON) trained on chat_corpus() there")
    args = parser.parse_args()
    if args.tokenizer:
        Path(args.tokenizer).write_text(train_chat_bpe(chat_corpus()))
        print(f"wrote the tiny-chat tokenizer to {args.tokenizer}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in word_problems(args.rows, args.seed)))
        print(f"wrote {args.rows} rows to {args.out}")
