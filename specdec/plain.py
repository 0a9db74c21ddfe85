"""Plain decoding by transformers' own generate(): the reference every greedy output of specdec must
equal (the tests, `specdec bench`, `specdec bench-served` and the soak hold the engine and the server to
it), and the peer's modes that `specdec bench` times beside ours."""

from collections.abc import Sequence

import torch


@torch.inference_mode()
def hf_generate(model, prompt: list[int], max_new_tokens: int, eos: Sequence[int] = (), **options) -> list[int]:
    """transformers generate() on one prompt -> its new tokens. Without options: greedy plain decoding.
    `options` go to generate() as they are (do_sample and the sampling parameters, assistant_model,
    prompt_lookup_num_tokens). eos: the ids that end a sequence; none: it runs to max_new_tokens."""
    return _generate(model, prompt, max_new_tokens, eos, **options)[0, len(prompt):].tolist()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: Sequence[int] = ()) -> list[int]:
    """Greedy plain decoding of one prompt -> its new tokens (hf_generate without options)."""
    return hf_generate(model, prompt, max_new_tokens, eos)


@torch.inference_mode()
def hf_greedy_margin(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """Greedy plain decoding of exactly max_new_tokens -> (new tokens, the smallest top-1 minus top-2 logit
    over its steps): a path that passes a near-tie may fairly differ under other rounding."""
    out = _generate(model, prompt, max_new_tokens, (), min_new_tokens=max_new_tokens, output_scores=True,
                    return_dict_in_generate=True)
    top2 = torch.stack(out.scores)[:, 0].float().topk(2, dim=-1).values  # [N, 2]
    return out.sequences[0, len(prompt):].tolist(), float((top2[:, 0] - top2[:, 1]).min())


def _generate(model, prompt: list[int], max_new_tokens: int, eos: Sequence[int], **options):
    ids = torch.tensor([prompt], device=model.device)
    eos = list(eos)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          **{"do_sample": False, **options}, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
