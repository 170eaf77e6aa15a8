#!/usr/bin/env python3
"""strata's tokenization of a corpus against transformers' fast tokenizer on
the same documents, the same tokenizer and the same cores, in one run.

Each round runs, in an order rotated every round:
  strata        `strata bench tokenize --rounds 1 --json`: what `strata train
                --data ... --tokenizer DIR` does before training (the
                sources checksummed, every document encoded, the token file
                written and synced), timed whole;
  transformers  PreTrainedTokenizerFast(tokenizer_file=...) called on the
                documents in batches of --batch (`tokenizer(texts)
                ["input_ids"]`, what a datasets.map(batched=True) pipeline
                runs), timed over the calls alone (reading the JSONL and
                writing nothing are not counted).
Both encode with the tokenizer's special tokens; strata appends the
end-of-text token after each document, and the check below appends it to
transformers' ids too: the two token streams must be equal, id for id, over
the whole corpus (the script exits 1 otherwise).

The corpus, unless --data names one: every fortune of Debian's `fortunes`
package (/usr/share/games/fortunes, about 2.6 MB of English text; `apt-get
install fortunes`), one document per fortune, as JSONL. The tokenizer,
unless --tokenizer names one: a byte-level BPE (GPT-2's pre-tokenizer and
byte alphabet) of --vocab ids trained on that corpus with the tokenizers
package, saved with a tokenizer_config.json naming <|endoftext|>.

Needs transformers and tokenizers (pip install transformers tokenizers; torch
is not needed). Prints a table, or one JSON object with --json.
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FORTUNES = "/usr/share/games/fortunes"


def fortune_corpus(path):
    """Every fortune as a JSONL document; the number of documents."""
    documents = 0
    with open(path, "w") as out:
        for name in sorted(glob.glob(os.path.join(FORTUNES, "*"))):
            if "." in os.path.basename(name) or os.path.isdir(name):
                continue
            with open(name, encoding="utf-8", errors="replace") as f:
                for text in f.read().split("\n%\n"):
                    text = text.strip("%\n")
                    if text:
                        out.write(json.dumps({"text": text}) + "\n")
                        documents += 1
    if documents == 0:
        sys.exit(f"no fortunes under {FORTUNES}: apt-get install fortunes, or pass --data")
    return documents


def train_tokenizer(corpus, directory, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(read_texts(corpus), trainer)
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)


def read_texts(corpus):
    with open(corpus) as f:
        texts = (json.loads(line)["text"] for line in f if line.strip())
        # strata skips empty documents (they would be a lone end-of-text).
        return [text for text in texts if text]


def run_strata(a, corpus, keep):
    command = [a.strata, "bench", "tokenize", "--data", corpus, "--tokenizer", a.tokenizer,
               "--rounds", "1", "--json", "--keep", keep]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_transformers(tokenizer, texts, batch):
    started = time.perf_counter()
    ids = []
    for i in range(0, len(texts), batch):
        ids.extend(tokenizer(texts[i : i + batch])["input_ids"])
    return time.perf_counter() - started, ids


def strata_ids(result):
    import array

    stream = array.array("H" if result["token_dtype"] == "u16" else "I")
    with open(result["token_file"], "rb") as f:
        stream.frombytes(f.read())
    return stream


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strata", default="target/release/strata")
    p.add_argument("--data", help="a JSONL corpus (default: Debian's fortunes)")
    p.add_argument("--tokenizer", help="a folder with tokenizer.json (default: one trained on the corpus)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as scratch:
        corpus = a.data
        if corpus is None:
            corpus = os.path.join(scratch, "fortunes.jsonl")
            fortune_corpus(corpus)
        if a.tokenizer is None:
            a.tokenizer = os.path.join(scratch, "tokenizer")
            train_tokenizer(corpus, a.tokenizer, a.vocab)
        texts = read_texts(corpus)
        config = json.load(open(os.path.join(a.tokenizer, "tokenizer_config.json")))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(a.tokenizer, "tokenizer.json"), eos_token=eos
        )
        eos_id = tokenizer.convert_tokens_to_ids(eos) if eos else None
        seconds = {"strata": [], "transformers": []}
        result = ids = None
        for r in range(a.rounds):
            order = ["strata", "transformers"] if r % 2 == 0 else ["transformers", "strata"]
            for peer in order:
                if peer == "strata":
                    result = run_strata(a, corpus, os.path.join(scratch, f"strata-{r}"))
                    seconds["strata"].append(result["seconds_median"])
                else:
                    s, ids = run_transformers(tokenizer, texts, a.batch)
                    seconds["transformers"].append(s)
        expected = []
        for document in ids:
            expected.extend(document)
            if eos_id is not None:
                expected.append(eos_id)
        got = strata_ids(result)
        equal = len(got) == len(expected) and all(x == y for x, y in zip(got, expected))
        mismatch = None
        if not equal:
            mismatch = next(
                (i for i, (x, y) in enumerate(zip(got, expected)) if x != y), min(len(got), len(expected))
            )
        tokens = len(expected)
        median = {peer: statistics.median(s) for peer, s in seconds.items()}
        rate = {peer: tokens / s for peer, s in median.items()}
        report = {
            "documents": len(texts),
            "tokens": tokens,
            "bytes": os.path.getsize(corpus),
            "cores": os.cpu_count(),
            "rounds": a.rounds,
            "seconds_median": median,
            "tokens_per_s": rate,
            "strata_over_transformers": rate["strata"] / rate["transformers"],
            "ids_equal": equal,
            "first_mismatch": mismatch,
        }
        if a.json:
            print(json.dumps(report))
        else:
            print(f"{len(texts)} documents, {tokens} tokens, {report['bytes']} bytes, {os.cpu_count()} cores, median of {a.rounds} rounds")
            for peer in ("strata", "transformers"):
                print(f"  {peer:13} {median[peer]:.3f} s  {rate[peer]:12.0f} tokens/s")
            print(f"  strata / transformers: {report['strata_over_transformers']:.2f}x; ids equal: {equal}")
        if not equal:
            sys.exit(f"token ids differ from token {mismatch} on")


if __name__ == "__main__":
    main()
