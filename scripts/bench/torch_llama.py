#!/usr/bin/env python3
"""The PyTorch baseline for the GPU benchmarks (scripts/gpu-check.sh): the same GGUF llama model in
eager PyTorch, as a Hugging Face transformers llama runs it (dequantized weights, fp16 on a GPU,
a preallocated KV cache, SDPA attention), with nothing but torch installed: the GPU machine is
known to have PyTorch, not transformers or gguf, and cannot install packages.

Prints one JSON object: single-stream decode tok/s, aggregate decode at each batch size (one
batch of equal prompts decoding together, as a static-batch server would), prefill of an N-token
prompt (cold TTFT) and of its last 10% with the rest already cached, and the greedy tokens of
"Once upon a time" (ids of the default model) for a check against our engine's.

    python3 scripts/bench/torch_llama.py MODEL.gguf [--device cuda] [--streams 1,16,64,256]
        [--prompt-tokens 4096] [--decode-tokens 128]
"""
import argparse
import json
import mmap
import struct
import time

import torch

# GGUF value types and their struct formats (strings and arrays are read apart).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
F32, F16, Q4_1, Q8_0 = 0, 1, 3, 8
# Bytes per block and weights per block of the formats we dequantize.
BLOCKS = {F32: (4, 1), F16: (2, 1), Q4_1: (20, 32), Q8_0: (34, 32)}


class Reader:
    def __init__(self, data):
        self.data, self.at = data, 0

    def take(self, fmt):
        value = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value[0]

    def string(self):
        n = self.take("Q")
        s = bytes(self.data[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return s

    def value(self, kind):
        if kind == 8:
            return self.string()
        if kind == 9:
            inner, n = self.take("I"), self.take("Q")
            return [self.value(inner) for _ in range(n)]
        return self.take(SCALARS[kind])


def read_gguf(path):
    """(metadata, {name: (dims, type, bytes)}) of a GGUF file (versions 2 and 3)."""
    with open(path, "rb") as f:  # mapped, not read: a 7B file is 7 GB
        data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    r = Reader(data)
    assert r.take("I") == 0x46554747, "not a GGUF file"
    r.take("I")  # version
    n_tensors, n_kv = r.take("Q"), r.take("Q")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.take("Q") for _ in range(r.take("I"))]
        infos.append((name, dims, r.take("I"), r.take("Q")))
    align = meta.get("general.alignment", 32)
    start = (r.at + align - 1) // align * align
    tensors = {}
    for name, dims, kind, offset in infos:
        per_block, weights = BLOCKS[kind]
        count = 1
        for d in dims:
            count *= d
        size = count // weights * per_block
        tensors[name] = (dims, kind, data[start + offset : start + offset + size])
    return meta, tensors


def dequantize(dims, kind, raw, device):
    """A float32 tensor of GGUF shape `dims` (innermost first), as [rows, cols], dequantized on
    `device` (on a GPU a 7B file's weights take seconds, not the CPU's minute)."""
    b = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    if kind == F32:
        x = b.view(torch.float32)
    elif kind == F16:
        x = b.view(torch.float16).float()
    elif kind == Q8_0:
        blocks = b.view(-1, 34)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        x = (blocks[:, 2:].contiguous().view(torch.int8).float() * scale).flatten()
    elif kind == Q4_1:
        blocks = b.view(-1, 20)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        q = blocks[:, 4:]
        # Low nibbles are weights 0..15 of the block, high nibbles 16..31.
        nibbles = torch.cat([q & 0x0F, q >> 4], dim=1).float()
        x = (nibbles * d + m).flatten()
    else:
        raise ValueError(f"unsupported GGUF type {kind}")
    return x.view(*reversed(dims)) if len(dims) > 1 else x


class Llama:
    def __init__(self, path, device, dtype):
        meta, tensors = read_gguf(path)
        arch = meta["general.architecture"]
        assert arch == "llama", f"only llama files ({arch})"
        get = lambda k, default=None: meta.get(f"{arch}.{k}", default)
        self.n_layer, self.hidden = get("block_count"), get("embedding_length")
        self.n_head = get("attention.head_count")
        self.n_kv = get("attention.head_count_kv", self.n_head)
        self.hd = self.hidden // self.n_head
        self.eps = get("attention.layer_norm_rms_epsilon")
        theta = get("rope.freq_base", 10000.0)
        self.device, self.dtype = device, dtype
        w = lambda name: dequantize(*tensors[name], device).to(dtype=dtype)
        self.embed = w("token_embd.weight")
        self.lm_head = w("output.weight") if "output.weight" in tensors else self.embed
        self.norm = w("output_norm.weight")
        self.layers = []
        for i in range(self.n_layer):
            p = lambda s: w(f"blk.{i}.{s}")
            qkv = torch.cat([p("attn_q.weight"), p("attn_k.weight"), p("attn_v.weight")])
            gate_up = torch.cat([p("ffn_gate.weight"), p("ffn_up.weight")])
            self.layers.append((p("attn_norm.weight"), qkv, p("attn_output.weight"), p("ffn_norm.weight"),
                                gate_up, p("ffn_down.weight")))
        inv = 1.0 / theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd)
        angles = torch.outer(torch.arange(meta.get(f"{arch}.context_length", 8192), dtype=torch.float32), inv)
        self.cos, self.sin = angles.cos().to(device), angles.sin().to(device)

    def rms(self, x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(self.dtype) * w

    def rope(self, x, pos):
        # GGUF llama weights pair adjacent dimensions (llama.cpp permutes them at conversion).
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        a, b = x.float()[..., 0::2], x.float()[..., 1::2]
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(self.dtype)

    def cache(self, batch, length):
        shape = (self.n_layer, 2, batch, self.n_kv, length, self.hd)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def forward(self, ids, start, kv):
        """ids [batch, n] at positions start..start+n; returns the last position's logits."""
        bsz, n = ids.shape
        pos = torch.arange(start, start + n, device=self.device)
        x = self.embed[ids]
        q_w, kv_w = self.n_head * self.hd, self.n_kv * self.hd
        for i, (attn_norm, qkv, wo, ffn_norm, gate_up, down) in enumerate(self.layers):
            h = self.rms(x, attn_norm) @ qkv.T
            q, k, v = h.split([q_w, kv_w, kv_w], dim=-1)
            q = self.rope(q.view(bsz * n, self.n_head, self.hd), pos.repeat(bsz)).view(bsz, n, self.n_head, self.hd)
            k = self.rope(k.view(bsz * n, self.n_kv, self.hd), pos.repeat(bsz)).view(bsz, n, self.n_kv, self.hd)
            kv[i, 0, :, :, start : start + n] = k.transpose(1, 2)
            kv[i, 1, :, :, start : start + n] = v.view(bsz, n, self.n_kv, self.hd).transpose(1, 2)
            keys, values = kv[i, 0, :, :, : start + n], kv[i, 1, :, :, : start + n]
            mask = None
            if n > 1:
                mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=self.n_kv != self.n_head)
            x = x + o.transpose(1, 2).reshape(bsz, n, q_w) @ wo.T
            g, u = (self.rms(x, ffn_norm) @ gate_up.T).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(g) * u) @ down.T
        return self.rms(x[:, -1], self.norm) @ self.lm_head.T


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_rate(model, batch, prompt, tokens):
    """Aggregate tokens/s of `batch` greedy streams after a shared-length prompt."""
    kv = model.cache(batch, len(prompt) + tokens + 1)
    ids = torch.tensor([prompt] * batch, device=model.device)
    nxt = model.forward(ids, 0, kv).argmax(-1, keepdim=True)
    sync(model.device)
    t = time.perf_counter()
    for step in range(tokens):
        nxt = model.forward(nxt, len(prompt) + step, kv).argmax(-1, keepdim=True)
    sync(model.device)
    return batch * tokens / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--streams", default="1,16,64,256")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=128)
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    t = time.perf_counter()
    model = Llama(a.model, device, dtype)
    out = {"torch": torch.__version__, "device": str(device), "dtype": str(dtype).split(".")[-1],
           "load_s": time.perf_counter() - t}

    # Greedy check: "Once upon a time" in the default model's ids.
    kv = model.cache(1, 64)
    ids, pos, greedy = torch.tensor([[6403, 1980, 253, 655]], device=device), 0, []
    for _ in range(16):
        nxt = model.forward(ids, pos, kv).argmax(-1, keepdim=True)
        pos += ids.shape[1]
        greedy.append(int(nxt))
        ids = nxt
    out["greedy_once_upon_a_time"] = greedy

    prompt = [6403, 1980, 253, 655]
    decode_rate(model, 1, prompt, 8)  # warm-up
    out["single_stream_tok_s"] = decode_rate(model, 1, prompt, a.decode_tokens)
    out["aggregate"] = [{"streams": b, "aggregate_tok_s": decode_rate(model, b, prompt, a.decode_tokens)}
                        for b in map(int, a.streams.split(","))]

    long = torch.randint(100, 40000, (1, a.prompt_tokens), device=device)
    cached = a.prompt_tokens * 9 // 10
    for name, start in [("cold", 0), ("cached", cached)]:
        runs = []
        for _ in range(3):
            kv = model.cache(1, a.prompt_tokens + 1)
            if start:
                model.forward(long[:, :start], 0, kv)
            sync(device)
            t = time.perf_counter()
            model.forward(long[:, start:], start, kv).argmax(-1)
            sync(device)
            runs.append((time.perf_counter() - t) * 1000)
        out[f"ttft_{name}_ms"] = sorted(runs)[1]
    out["prompt_tokens"], out["cached_prefix_tokens"] = a.prompt_tokens, cached
    out["prefill_tok_s"] = a.prompt_tokens / out["ttft_cold_ms"] * 1000
    print(json.dumps(out))


if __name__ == "__main__":
    main()
