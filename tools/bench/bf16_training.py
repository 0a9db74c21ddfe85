"""One training step of the default draft's shape (a 2-layer, 256-wide Llama over SmolLM2's 49152-token
vocabulary; 16 x 128 tokens, AdamW) in float32 and under bfloat16 autocast, alternated in one process: whether
bfloat16 pays on this CPU (specdec.default_models.fast_bf16 says it does only with AMX).

    python -m tools.bench.bf16_training [--repeats 3]
"""

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per measurement")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, config.vocab_size, (16, 128))  # [B, S]

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    print(f"AMX {torch.cpu._is_amx_tile_supported()}, AVX512-BF16 {torch.cpu._is_avx512_bf16_supported()}, "
          f"torch threads {torch.get_num_threads()}")
    for bf16 in (False, True, False, True):
        step(bf16)  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            step(bf16)
        print(f"{'bfloat16' if bf16 else 'float32 '} {(time.perf_counter() - t0) / args.repeats:.2f} s a step", flush=True)


if __name__ == "__main__":
    main()
