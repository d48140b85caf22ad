"""Train the tiny engine's transformer on the KJV corpus with PyTorch; export safetensors.

Usage: python scripts/train_model.py [--steps 900] [--batch 32]
Needs: torch==2.13.0 (CPU build), safetensors, tokenizers, matplotlib; run
scripts/train_tokenizer.py first. Parameter names follow Hugging Face's Llama layout, so the
export loads into ``transformers.LlamaForCausalLM`` as well as into the NumPy model.
Writes src/replystream/engine/tiny_assets/{model.safetensors,config.json} and
docs/model-loss.png, docs/model-loss.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "src/replystream/engine/tiny_assets"

CONFIG = {
    "vocab_size": 4096,
    "d_model": 128,
    "n_layers": 4,
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_ff": 352,
    "context": 256,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
}


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, c: dict[str, float]) -> None:
        super().__init__()
        d, h, kv = int(c["d_model"]), int(c["n_heads"]), int(c["n_kv_heads"])
        self.h, self.kv, self.hd = h, kv, d // h
        self.input_layernorm = nn.RMSNorm(d, eps=c["norm_eps"])
        self.post_attention_layernorm = nn.RMSNorm(d, eps=c["norm_eps"])
        self.self_attn = nn.ModuleDict(
            {
                "q_proj": nn.Linear(d, h * self.hd, bias=False),
                "k_proj": nn.Linear(d, kv * self.hd, bias=False),
                "v_proj": nn.Linear(d, kv * self.hd, bias=False),
                "o_proj": nn.Linear(h * self.hd, d, bias=False),
            }
        )
        f = int(c["d_ff"])
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(d, f, bias=False),
                "up_proj": nn.Linear(d, f, bias=False),
                "down_proj": nn.Linear(f, d, bias=False),
            }
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        a = self.self_attn
        y = self.input_layernorm(x)
        q = a["q_proj"](y).view(B, T, self.h, self.hd).transpose(1, 2)
        k = a["k_proj"](y).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = a["v_proj"](y).view(B, T, self.kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a["o_proj"](att.transpose(1, 2).reshape(B, T, -1))
        y = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m["down_proj"](F.silu(m["gate_proj"](y)) * m["up_proj"](y))


class TinyLM(nn.Module):
    def __init__(self, c: dict[str, float]) -> None:
        super().__init__()
        self.c = c
        self.model = nn.ModuleDict(
            {
                "embed_tokens": nn.Embedding(int(c["vocab_size"]), int(c["d_model"])),
                "layers": nn.ModuleList(Block(c) for _ in range(int(c["n_layers"]))),
                "norm": nn.RMSNorm(int(c["d_model"]), eps=c["norm_eps"]),
            }
        )
        hd = int(c["d_model"]) // int(c["n_heads"])
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(int(c["context"])).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        T = ids.shape[1]
        x = self.model["embed_tokens"](ids)
        cos, sin = self.cos[:T], self.sin[:T]
        for block in self.model["layers"]:
            x = block(x, cos, sin)
        return self.model["norm"](x) @ self.model["embed_tokens"].weight.T  # tied unembedding


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--corpus", type=Path, default=ROOT / "build/kjv.txt")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)

    tokenizer = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    ids = torch.tensor(tokenizer.encode(args.corpus.read_text(encoding="utf-8")).ids)
    split = int(len(ids) * 0.98)
    train, val = ids[:split], ids[split:]
    model = TinyLM(CONFIG)
    n_params = sum(p.numel() for p in model.parameters())
    T = int(CONFIG["context"])
    print(f"{n_params:,} parameters; {len(train):,} training tokens, {len(val):,} held out")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def batch(data: Tensor, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        starts = torch.randint(0, len(data) - T - 1, (n,), generator=gen)
        x = torch.stack([data[s : s + T] for s in starts])
        y = torch.stack([data[s + 1 : s + T + 1] for s in starts])
        return x, y

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        x, y = batch(val, 64, torch.Generator().manual_seed(0))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
        model.train()
        return loss

    gen = torch.Generator().manual_seed(args.seed)
    curve: list[dict[str, float]] = []
    began = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = batch(train, args.batch, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            point = {"step": step, "seconds": time.perf_counter() - began, "train": loss.item()}
            if step % 100 == 0 or step == args.steps - 1:
                point["val"] = val_loss()
            curve.append(point)
            print(json.dumps(point), flush=True)
    seconds = time.perf_counter() - began

    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(ASSETS / "model.safetensors"), metadata={"format": "pt"})
    (ASSETS / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    summary = {
        "parameters": n_params,
        "steps": args.steps,
        "batch": args.batch,
        "context": T,
        "tokens_seen": args.steps * args.batch * T,
        "train_seconds": round(seconds, 1),
        "final_train_loss": curve[-1]["train"],
        "final_val_loss": curve[-1]["val"],
        "curve": curve,
    }
    (ROOT / "docs/model-loss.json").write_text(json.dumps(summary, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["step"] for p in curve], [p["train"] for p in curve], label="train")
    vals = [p for p in curve if "val" in p]
    ax.plot([p["step"] for p in vals], [p["val"] for p in vals], "o-", label="held out (2%)")
    ax.set_xlabel("step (batch 32 x 256 tokens)")
    ax.set_ylabel("cross-entropy (nats/token)")
    minutes = seconds / 60
    ax.set_title(f"tiny engine: {n_params / 1e6:.2f}M params, {minutes:.1f} min on 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "docs/model-loss.png", dpi=110)
    last = curve[-1]
    print(f"done in {seconds:.0f} s; final train {last['train']:.3f}, val {last['val']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
