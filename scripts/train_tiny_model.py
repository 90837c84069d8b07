#!/usr/bin/env python3
"""Train `tandem-tiny`: a small, real Llama checkpoint that Tandem ships as its default model.

Everything is built offline from text under a permissive license: the Python standard
library's own source files (PSF License). The script

1. gathers the stdlib *.py files (sorted, test folders and very large files skipped, capped
   at --max-corpus-mb) and holds out every --val-every-th file for validation;
2. trains a byte-level BPE tokenizer (``tokenizers``) with the special tokens
   ``<|endoftext|>`` (bos/eos/pad), ``<|im_start|>`` and ``<|im_end|>`` and a ChatML chat template;
3. trains a ~3.9M-parameter ``LlamaForCausalLM`` (GQA, tied embeddings) with plain PyTorch
   (AdamW, warmup + cosine LR over a wall-clock budget, random 256-token windows of the corpus
   mixed with chat-formatted samples built from docstrings);
4. saves the model in bfloat16 safetensors plus the tokenizer and a model card to --out.

Reproduce the shipped checkpoint with::

    python scripts/train_tiny_model.py --threads 1 --minutes 20

The LR schedule follows the wall clock, so the exact number of steps (and the final loss) depends on
the machine; pass --max-steps N to make the schedule step-based and the run fully deterministic.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from typing import Any, Callable

BOS = EOS = PAD = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]  # ids 0, 1, 2

# ChatML. Kept deliberately simple so any Jinja renderer (HF, minijinja, ...) handles it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
SYSTEM_PROMPT = "You are a helpful assistant that knows the Python standard library."


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/tandem-tiny", help="output folder (default: %(default)s)")
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N steps; makes the LR schedule step-based")
    p.add_argument("--threads", type=int, default=1, help="torch/tokenizers CPU threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-corpus-mb", type=float, default=24.0, help="cap on gathered text (default: %(default)s)")
    p.add_argument("--max-file-kb", type=int, default=200, help="skip source files larger than this")
    p.add_argument("--val-every", type=int, default=25, help="hold out every N-th file for validation")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer", default=None, help="reuse this folder's tokenizer instead of training one (a "
                   "speculative-decoding draft for a model trained here: --tokenizer models/tandem-tiny)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=704)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--amp", choices=["bf16", "none"], default="bf16",
                   help="CPU autocast for forward/backward; weights and optimizer stay fp32 (default: %(default)s)")
    p.add_argument("--chat-frac", type=float, default=0.1, help="fraction of batch rows drawn from chat samples")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every-minutes", type=float, default=4.0)
    p.add_argument("--val-windows", type=int, default=64)
    return p.parse_args()


# --------------------------------------------------------------------------- corpus


def gather_corpus(max_bytes: int, max_file_bytes: int, val_every: int):
    """Return (train_docs, val_docs, root, n_files): lists of (relative path, text), sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                paths.append(os.path.join(dirpath, fn))
    paths.sort()
    docs, total = [], 0
    for path in paths:
        if os.path.getsize(path) > max_file_bytes:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or "gencodec.py" in text:
            continue  # empty, or a generated codec table (encodings/cp*.py ...): ~1.3 MB of hex tables, not code
        if total + len(text.encode()) > max_bytes:
            break
        total += len(text.encode())
        docs.append((os.path.relpath(path, root), text))
    train = [d for i, d in enumerate(docs) if (i + 1) % val_every != 0]
    val = [d for i, d in enumerate(docs) if (i + 1) % val_every == 0]
    return train, val, root, len(docs)


def _first_paragraph(doc: str, limit: int = 500) -> str:
    para = doc.strip().split("\n\n")[0]
    para = " ".join(line.strip() for line in para.splitlines()).strip()
    return para if len(para) <= limit else para[: limit - 3].rsplit(" ", 1)[0] + "..."


def chat_samples(docs, rng: random.Random):
    """Chat conversations (lists of messages) built from docstrings of public functions and classes."""
    out = []
    for rel, text in docs:
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20:
                continue
            summary = _first_paragraph(doc)
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
            r = rng.random()
            # whole lines of the definition (ast.get_source_segment re-splits the file on every call: slow)
            src = "".join(lines[node.lineno - 1 : node.end_lineno]).rstrip() if node.end_lineno else None
            if node.decorator_list:
                src = None  # keep it simple: decorated definitions only get the "explain" form
            if r < 0.5 or not src or len(src) > 1500:
                q = rng.choice(
                    [
                        f"What does the {kind} `{node.name}` in the `{module}` module do?",
                        f"Explain `{module}.{node.name}`.",
                        f"What is `{node.name}` used for in `{module}`?",
                    ]
                )
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": summary}]
            else:
                src = textwrap.dedent(src)
                q = f"Write the {kind} `{node.name}` from the `{module}` module. {summary.split('. ')[0].rstrip('.')}."
                messages += [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": f"```python\n{src}\n```"},
                ]
            out.append(messages)
    return out


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(train_docs, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text for _, text in train_docs), trainer=trainer, length=len(train_docs))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    return hf


def save_tokenizer(hf_tok, out: str) -> None:
    hf_tok.save_pretrained(out)
    # Make the config loadable by older transformers too (4.x knows no "TokenizersBackend") and keep the
    # chat template inline as well as in chat_template.jinja (same text; either reader finds it).
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["model_max_length"] = 1024
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")


# --------------------------------------------------------------------------- training


def build_stream(token_lists, eos_id: int):
    """Concatenate token lists, each followed by eos. Returns (LongTensor stream, list of start offsets)."""
    import torch

    starts, flat = [], []
    for ids in token_lists:
        starts.append(len(flat))
        flat.extend(ids)
        flat.append(eos_id)
    return torch.tensor(flat, dtype=torch.long), starts


@dataclass
class Data:
    """The corpus, the tokenizer as shipped, and the token streams the training draws from."""
    train_docs: list
    val_docs: list
    n_files: int
    train_bytes: int
    val_bytes: int
    tok: Any
    eos_id: int
    im_end_id: int
    vocab: int
    train_stream: Any
    val_stream: Any
    chats_train: list
    chat_stream: Any
    chat_starts: list[int]
    chat_val_stream: Any
    chat_val_starts: list[int]


@dataclass
class TrainResult:
    steps: int
    history: list[tuple[int, float]]
    train_s: float
    final_train: float
    val_fp32: float


def make_logger(t_start: float) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    return log


def prepare_data(args: argparse.Namespace, rng: random.Random, log: Callable[[str], None]) -> Data:
    """1. gather the corpus, 2. train and save the tokenizer, then tokenize documents and chat samples."""
    from transformers import AutoTokenizer

    out = args.out
    train_docs, val_docs, root, n_files = gather_corpus(
        int(args.max_corpus_mb * 1e6), args.max_file_kb * 1000, args.val_every
    )
    train_bytes = sum(len(t.encode()) for _, t in train_docs)
    val_bytes = sum(len(t.encode()) for _, t in val_docs)
    log(f"corpus: {n_files} files from {root}: train {len(train_docs)} files / {train_bytes / 1e6:.2f} MB, "
        f"val {len(val_docs)} files / {val_bytes / 1e6:.2f} MB")

    if args.tokenizer:  # a draft model for speculative decoding must speak its target's tokens
        hf_tok = AutoTokenizer.from_pretrained(args.tokenizer)
        log(f"tokenizer: reused from {args.tokenizer}")
    else:
        hf_tok = train_tokenizer(train_docs, args.vocab_size)
    save_tokenizer(hf_tok, out)
    tok = AutoTokenizer.from_pretrained(out)  # use exactly what we ship
    eos_id = tok.convert_tokens_to_ids(EOS)
    im_start_id, im_end_id = tok.convert_tokens_to_ids(IM_START), tok.convert_tokens_to_ids(IM_END)
    vocab = len(tok)
    probe = "def f(x):\n    return x  # héllo wörld 日本語 🐍\n"
    assert tok.decode(tok(probe)["input_ids"]) == probe, "byte-level round trip failed"
    log(f"tokenizer: vocab {vocab}, eos={eos_id} im_start={im_start_id} im_end={im_end_id}")

    def encode(texts):
        return [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)] if texts else []

    train_stream, _ = build_stream(encode([t for _, t in train_docs]), eos_id)
    val_stream, _ = build_stream(encode([t for _, t in val_docs]), eos_id)
    chats_train = chat_samples(train_docs, rng)
    chats_val = chat_samples(val_docs, rng)
    render = lambda convs: [tok.apply_chat_template(c, tokenize=False) for c in convs]  # noqa: E731
    chat_stream, chat_starts = build_stream(encode(render(chats_train)), eos_id)
    chat_val_stream, chat_val_starts = build_stream(encode(render(chats_val)), eos_id)
    log(f"tokens: train {len(train_stream):,} ({train_bytes / len(train_stream):.2f} bytes/token), "
        f"val {len(val_stream):,}; chat samples: train {len(chats_train):,} ({len(chat_stream):,} tokens), "
        f"val {len(chats_val):,}")
    return Data(train_docs=train_docs, val_docs=val_docs, n_files=n_files, train_bytes=train_bytes,
                val_bytes=val_bytes, tok=tok, eos_id=eos_id, im_end_id=im_end_id, vocab=vocab,
                train_stream=train_stream, val_stream=val_stream, chats_train=chats_train, chat_stream=chat_stream,
                chat_starts=chat_starts, chat_val_stream=chat_val_stream, chat_val_starts=chat_val_starts)


def build_model(args: argparse.Namespace, vocab: int, eos_id: int):
    """3. a freshly initialised LlamaForCausalLM of the requested shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaForCausalLM(config)


def make_optimizer(args: argparse.Namespace, model):
    """AdamW, with weight decay on the matrices only."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )


def lr_at(args: argparse.Namespace, step: int, frac: float) -> float:
    """Linear warmup over --warmup-steps, then cosine decay to --min-lr-ratio as `frac` goes 0 -> 1."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    frac = min(max(frac, 0.0), 1.0)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def sample_batch(args: argparse.Namespace, data: Data, g: random.Random):
    """A [batch, seq_len + 1] batch of random windows: corpus text, or (--chat-frac of rows) chat samples."""
    import torch

    L = args.seq_len
    rows = []
    for _ in range(args.batch_size):
        if data.chat_starts and g.random() < args.chat_frac:
            s = min(g.choice(data.chat_starts), len(data.chat_stream) - L - 1)
            rows.append(data.chat_stream[s : s + L + 1])
        else:
            s = g.randrange(0, len(data.train_stream) - L - 1)
            rows.append(data.train_stream[s : s + L + 1])
    return torch.stack(rows)


def fixed_windows(stream, starts, n: int, seed: int, L: int):
    """n windows of L + 1 tokens of `stream` (at sample starts if given), the same on every call; None if too short."""
    import torch

    g = random.Random(seed)
    if len(stream) <= L + 1:
        return None
    if starts:
        picks = [min(g.choice(starts), len(stream) - L - 1) for _ in range(n)]
    else:
        picks = [g.randrange(0, len(stream) - L - 1) for _ in range(n)]
    return torch.stack([stream[s : s + L + 1] for s in picks])


def evaluate(m, windows, batch_size: int) -> float:
    """Mean next-token cross-entropy of `m` over `windows` (nan when there are none)."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        if windows is None:
            return float("nan")
        m.eval()
        tot, n = 0.0, 0
        for i in range(0, len(windows), batch_size):
            x = windows[i : i + batch_size]
            logits = m(input_ids=x[:, :-1]).logits.float()
            tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
            n += x[:, 1:].numel()
        m.train()
        return tot / n


def train(args: argparse.Namespace, model, data: Data, val_windows, log: Callable[[str], None]) -> TrainResult:
    """The training loop: until --max-steps, or the wall-clock budget when that is unset."""
    import torch
    import torch.nn.functional as F

    opt = make_optimizer(args, model)
    L = args.seq_len
    budget_s = args.minutes * 60.0
    log(f"initial val loss {evaluate(model, val_windows, args.batch_size):.3f} "
        f"(uniform = ln {data.vocab} = {math.log(data.vocab):.3f})")
    log(f"training: budget {args.minutes} min, max_steps {args.max_steps}, batch {args.batch_size}x{L}, "
        f"threads {args.threads}, lr {args.lr}, amp {args.amp}")

    model.train()
    data_rng = random.Random(args.seed + 3)
    step, recent, history = 0, [], []
    t_train = time.time()
    last_eval = t_train
    while True:
        elapsed = time.time() - t_train
        if args.max_steps is not None:
            if step >= args.max_steps:
                break
            frac = step / args.max_steps
        else:
            if elapsed >= budget_s:
                break
            frac = elapsed / budget_s
        lr = lr_at(args, step, frac)
        for group in opt.param_groups:
            group["lr"] = lr
        x = sample_batch(args, data, data_rng)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(loss.item())
        recent = recent[-args.log_every * 2 :]
        if step % args.log_every == 0:
            avg = sum(recent[-args.log_every :]) / len(recent[-args.log_every :])
            sps = step / (time.time() - t_train)
            log(f"step {step:5d}  loss {avg:.3f}  lr {lr:.2e}  {sps:.2f} steps/s  {sps * x.numel():.0f} tok/s")
        if time.time() - last_eval >= args.eval_every_minutes * 60:
            v = evaluate(model, val_windows, args.batch_size)
            history.append((step, v))
            log(f"step {step:5d}  val loss {v:.3f}")
            last_eval = time.time()

    train_s = time.time() - t_train
    final_train = sum(recent[-args.log_every :]) / max(1, len(recent[-args.log_every :]))
    val_fp32 = evaluate(model, val_windows, args.batch_size)
    log(f"done: {step} steps in {train_s / 60:.1f} min; train loss (last {args.log_every} steps) {final_train:.3f}, "
        f"val loss fp32 {val_fp32:.3f}")
    return TrainResult(steps=step, history=history, train_s=train_s, final_train=final_train, val_fp32=val_fp32)


def save_model(model, out: str, eos_id: int, im_end_id: int):
    """4. save in bf16 (with the generation config and a classic config.json) and reload what we ship."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=[eos_id, im_end_id],  # stop on end-of-text and on the end of an assistant turn
        pad_token_id=eos_id,
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 writes RoPE settings only as `rope_parameters`; keep the classic top-level key too so
    # readers of the raw config.json (and transformers 4.x) see the same theta.
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    raw.setdefault("rope_theta", raw.get("rope_parameters", {}).get("rope_theta", 10000.0))
    with open(cfg_path, "w") as f:
        json.dump(raw, f, indent=2, sort_keys=True)
        f.write("\n")
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    shipped.eval()
    return shipped


def main() -> int:
    args = parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # tokenizers' thread pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if args.threads > 1 else "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    log = make_logger(time.time())
    out = args.out
    os.makedirs(out, exist_ok=True)

    data = prepare_data(args, rng, log)
    model = build_model(args, data.vocab, data.eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters")
    L = args.seq_len
    val_windows = fixed_windows(data.val_stream, None, args.val_windows, args.seed + 1, L)
    chat_val_windows = fixed_windows(data.chat_val_stream, data.chat_val_starts, max(8, args.val_windows // 4),
                                     args.seed + 2, L)
    result = train(args, model, data, val_windows, log)

    shipped = save_model(model, out, data.eos_id, data.im_end_id)
    val_bf16 = evaluate(shipped, val_windows, args.batch_size)
    chat_val = evaluate(shipped, chat_val_windows, args.batch_size)
    log(f"shipped bf16 weights: val loss {val_bf16:.3f}, chat val loss {chat_val:.3f}")

    samples = card_samples(shipped, data.tok)
    for title, text in samples:
        log(f"sample {title}:\n{text}\n" + "-" * 60)

    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files if f != "README.md")
    cmd = "python scripts/train_tiny_model.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    step = result.steps
    write_card(
        out,
        dict(
            n_files=data.n_files, train_files=len(data.train_docs), val_files=len(data.val_docs),
            train_mb=data.train_bytes / 1e6, val_mb=data.val_bytes / 1e6, train_tokens=len(data.train_stream),
            val_tokens=len(data.val_stream), chat_train=len(data.chats_train), python=platform.python_version(),
            vocab=data.vocab, n_params=n_params, args=args, steps=step, train_min=result.train_s / 60,
            final_train=result.final_train, val_fp32=result.val_fp32, val_bf16=val_bf16, chat_val=chat_val,
            tokens_seen=step * args.batch_size * L, cmd=cmd, samples=samples, torch=torch.__version__,
            transformers=transformers.__version__, size_mb=size / 1e6, history=result.history,
            uniform=math.log(data.vocab), eos_id=data.eos_id, im_end_id=data.im_end_id,
            cpu=platform.processor() or platform.machine(),
            repro_note=(
                " (the LR schedule follows the wall clock, so steps and losses vary a little by machine; add"
                f" `--max-steps {step}` for a step-based, deterministic schedule)" if args.max_steps is None else ""
            ),
        ),
    )
    log(f"wrote {out} ({size / 1e6:.2f} MB without README): {', '.join(files)}")
    return 0


# Prompts for the model card. They end on a word, not on a space or newline: a prompt that stops mid-token
# (e.g. "def " whose space belongs to the next token " name") derails a model this small.
SAMPLE_PROMPTS = ["def", "import os\n", "class Queue"]
SAMPLE_CHATS = [
    "What does the function `join` in the `posixpath` module do?",
    "Write the function `basename` from the `posixpath` module. Returns the final component of a pathname.",
]


def card_samples(model, tok, max_new_tokens: int = 80) -> list[tuple[str, str]]:
    """Greedy generations (title, prompt + continuation) for the model card."""
    import torch

    def greedy(text: str, n: int) -> str:
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        return text + tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)

    out = [(f"`{prompt!r}`", greedy(prompt, max_new_tokens)) for prompt in SAMPLE_PROMPTS]
    for question in SAMPLE_CHATS:
        text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                       tokenize=False)
        out.append((f"chat: {question}", greedy(text, 100)))
    return out


def _card_front_and_data(d: dict) -> str:
    """The front matter, the introduction and the Data section."""
    a = d["args"]
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, tiny, python, tandem]
---

# tandem-tiny

A very small Llama-architecture language model trained from scratch on CPU on the Python standard
library's source code. It is Tandem's default model: small enough to ship in the repository and load in
tests, real enough that its output is recognisably Python. It is **not** a useful assistant; its chat
answers are mostly docstring-flavoured text.

## Data

- **Source:** the `*.py` files of the Python {d['python']} standard library (`sysconfig.get_paths()["stdlib"]`),
  sorted by path; `test/`, `tests/`, `idle_test/`, `site-packages/` folders and files over {a.max_file_kb} KB and codec tables generated by `gencodec.py` (most of `encodings/`) skipped;
  capped at {a.max_corpus_mb} MB.
- {d['n_files']} files: {d['train_files']} for training ({d['train_mb']:.2f} MB, {d['train_tokens']:,} tokens), every
  {a.val_every}th file held out for validation ({d['val_files']} files, {d['val_mb']:.2f} MB, {d['val_tokens']:,} tokens).
- {d['chat_train']:,} ChatML conversations generated from the training files' docstrings ("What does `x` do?" →
  first docstring paragraph; "Write the function `x`..." → its source), drawn for ~{a.chat_frac:.0%} of batch rows.
- **Data license:** Python Software Foundation License (PSF-2.0), a permissive license.

"""


def _card_license_and_architecture(d: dict) -> str:
    """The License and Architecture sections."""
    a = d["args"]
    return f"""## License

The weights and tokenizer are released under the **Apache-2.0** license (as is Tandem). The training data is
PSF-licensed Python source code.

## Architecture

| | |
|---|---|
| class | `LlamaForCausalLM` |
| parameters | {d['n_params']:,} (tied input/output embeddings) |
| hidden size | {a.hidden_size} |
| layers | {a.layers} |
| attention heads / KV heads | {a.heads} / {a.kv_heads} (GQA), head dim {a.hidden_size // a.heads} |
| MLP intermediate size | {a.intermediate_size} (SiLU-gated) |
| vocabulary | {d['vocab']} (byte-level BPE) |
| max position embeddings | 1024 (RoPE, theta 10000) |
| weights | bfloat16 safetensors, {d['size_mb']:.2f} MB folder |

**Tokenizer:** byte-level BPE trained on the same training files (any Unicode text round-trips). Special
tokens: `<|endoftext|>` (id {d['eos_id']}; bos, eos and pad), `<|im_start|>`, `<|im_end|>` (id {d['im_end_id']}).
No token is added automatically when encoding. The chat template is ChatML
(`<|im_start|>role\\n...<|im_end|>\\n`, roles system/user/assistant) and supports `add_generation_prompt`.
`generation_config.json` stops on `<|endoftext|>` or `<|im_end|>`.

"""


def _card_training(d: dict) -> str:
    """The Training section: settings, losses, validation history and the command to reproduce."""
    a = d["args"]
    hist = "".join(f"| {s} | {v:.3f} |\n" for s, v in d["history"])
    return f"""## Training

- Plain PyTorch {d['torch']} on CPU, transformers {d['transformers']}, {a.threads} thread(s) ({d['cpu']}), fp32 master weights{", bf16 autocast" if a.amp == "bf16" else ""}.
- AdamW (betas 0.9/0.95, weight decay {a.weight_decay}, grad clip 1.0), peak LR {a.lr}, {a.warmup_steps} warmup steps, cosine
  decay to {a.min_lr_ratio:g}x over the wall-clock budget.
- Batches of {a.batch_size} random {a.seq_len}-token windows; documents separated by `<|endoftext|>`.
- **{d['steps']} steps in {d['train_min']:.1f} minutes** (~{d['tokens_seen'] / 1e6:.1f}M tokens seen), seed {a.seed}.

| metric | value |
|---|---|
| final train loss (mean of last {a.log_every} steps) | {d['final_train']:.3f} |
| validation loss, fp32 (held-out files, {a.val_windows} windows x {a.seq_len}) | {d['val_fp32']:.3f} |
| validation loss, shipped bf16 weights | {d['val_bf16']:.3f} |
| validation loss on held-out chat samples (bf16) | {d['chat_val']:.3f} |
| uniform baseline, ln({d['vocab']}) | {d['uniform']:.3f} |

{"| step | val loss |" + chr(10) + "|---|---|" + chr(10) + hist if hist else ""}
Reproduce{d['repro_note']}:

```bash
{d['cmd']}
```

"""


def _card_samples_and_usage(d: dict) -> str:
    """The Samples and Usage sections."""
    samples = "\n".join(f"**{t}**\n\n````text\n{s}\n````\n" for t, s in d["samples"])
    return f"""## Samples

Greedy decoding, bf16 weights. Expect repetition: the model is tiny. End prompts on a word rather than a
trailing space or newline (the byte-level BPE attaches leading whitespace to the next token).

{samples}
## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("models/tandem-tiny")
model = AutoModelForCausalLM.from_pretrained("models/tandem-tiny")
ids = tok("import os\\n", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=60, do_sample=False)[0]))
```
"""


def write_card(out: str, d: dict) -> None:
    card = "".join(section(d) for section in (_card_front_and_data, _card_license_and_architecture, _card_training,
                                                _card_samples_and_usage))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card)


if __name__ == "__main__":
    sys.exit(main())
