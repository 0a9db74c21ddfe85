"""A `.gguf` file as a model path (specdec.gguf): a tiny random Llama is saved with save_pretrained (the
reference) and written as llama.cpp's converter lays it out (architecture "llama", its tensor names, q/k
rows permuted for its rope, a byte-level BPE tokenizer and a chat template in the metadata). Loaded from the
.gguf path, it must be that model: the same logits, the same token ids, the same greedy decode through
specdec's engine and served; converted once into the cache, keyed by the file's hash; and a file that
cannot be served is refused naming the file and why."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from cluster.local import free_port
from specdec import CachedLM, SpecConfig, SpeculativeEngine
from specdec.cli import main
from specdec.drafter_factory import make_drafter
from specdec.errors import UnsupportedModel
from specdec.gguf import FORMAT
from specdec.loading import eos_ids, load_model, load_served_model, load_tokenizer
from specdec.plain import hf_greedy, hf_greedy_margin

from conftest import MIN_GAP
from test_example_configs import PROMPT, ROOT, first_reply, kill_if_running, stop_cleanly

EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["def parse_header(line):\n    key, value = line.split(':', 1)\n    return key.strip(), value.strip()",
          "the quick brown fox jumps over the lazy dog, and the dog sleeps on."] * 20
TEXTS = [PROMPT, "the lazy fox parses a header", "héllo wörld 123 " + EOS + " then more", "  two  spaces\n\ttab"]
NEW_TOKENS = 16


# --- the reference model and its GGUF files -----------------------------------------------------------

def train_tokenizer() -> Tokenizer:
    """A byte-level BPE (GPT-2's kind) of a few hundred tokens, EOS its id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def tiny_llama(vocab: int) -> LlamaForCausalLM:
    """Random weights, grouped-query attention, an untied lm_head scaled up so greedy choices are clear."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def rope_permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows as llama.cpp's converter stores them (its rope pairs adjacent rows, transformers' halves)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


LAYER_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """llama.cpp's tensor name -> its float32 array, for a transformers Llama."""
    state, config = {k: v.numpy() for k, v in model.state_dict().items()}, model.config
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"]}
    for i in range(config.num_hidden_layers):
        for name, hf_name in LAYER_TENSORS.items():
            weight = state[f"model.layers.{i}.{hf_name}.weight"]
            tensors[f"blk.{i}.{name}.weight"] = rope_permuted(weight, heads[name]) if name in heads else weight
    tensors["output_norm.weight"] = state["model.norm.weight"]
    tensors["output.weight"] = state["lm_head.weight"]
    return tensors


def add_llama_metadata(writer: gguf.GGUFWriter, config: LlamaConfig) -> None:
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)


def add_tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer: Tokenizer) -> None:
    """As llama.cpp writes a GPT-2 style BPE: tokens in id order, their types (3: control), merges."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == EOS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]])
    writer.add_bos_token_id(vocab[EOS])
    writer.add_eos_token_id(vocab[EOS])
    writer.add_chat_template(CHAT_TEMPLATE)


def quantized(name: str, array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether llama.cpp quantizes this tensor at qtype: matrices (not norms) whose rows fill whole blocks."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype != gguf.GGMLQuantizationType.F32 and array.ndim == 2 and array.shape[1] % block == 0


def encoded(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The array's bytes at qtype by gguf's quantizer; zeros of that size for a type it has none for (Q8_1)."""
    try:
        return gguf.quants.quantize(array, qtype)
    except NotImplementedError:
        return np.zeros(gguf.quants.quant_shape_to_byte_shape(array.shape, qtype), np.uint8)


def write_gguf(path: Path, model: LlamaForCausalLM, tokenizer: Tokenizer, architecture: str = "llama",
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """The model as a GGUF file: its matrices at qtype (gguf's own quantizer), the rest float32."""
    writer = gguf.GGUFWriter(str(path), architecture)
    add_llama_metadata(writer, model.config)
    add_tokenizer_metadata(writer, tokenizer)
    for name, array in gguf_tensors(model).items():
        if quantized(name, array, qtype):
            writer.add_tensor(name, encoded(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class Reference:
    """The tiny Llama and its tokenizer as transformers saves them, and GGUF files of it."""

    def __init__(self, root: Path):
        self.root = root
        self.tokenizer_model = train_tokenizer()
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer_model, bos_token=EOS,
                                                 eos_token=EOS, chat_template=CHAT_TEMPLATE)
        self.model = tiny_llama(self.tokenizer_model.get_vocab_size())
        self.folder = root / "reference"
        self.model.save_pretrained(self.folder)
        self.tokenizer.save_pretrained(self.folder)
        self.eos = [self.tokenizer.convert_tokens_to_ids(EOS)]

    def gguf(self, name: str, **kwargs) -> str:
        """A GGUF file of the model (written once per name) -> its path."""
        path = self.root / f"{name}.gguf"
        if not path.exists():
            write_gguf(path, self.model, self.tokenizer_model, **kwargs)
        return str(path)

    def prompts(self) -> list[list[int]]:
        return [self.tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """specdec's cache (where .gguf files are converted to) in the test's own folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "specdec" / "gguf"


@pytest.fixture(scope="module")
def from_gguf(ref, tmp_path_factory) -> LlamaForCausalLM:
    """The model loaded from its F32 .gguf path, as specdec serves it (linear layers packed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        return load_served_model(ref.gguf("f32"))


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


# --- the model from a .gguf path is the reference model ------------------------------------------------

def test_f32_gguf_loads_as_the_same_model(ref):
    model = load_model(ref.gguf("f32"))
    ids = list(range(0, model.config.vocab_size, 3))
    assert torch.equal(logits(model, ids), logits(ref.model, ids))
    assert eos_ids(model.generation_config, load_tokenizer(ref.gguf("f32"))) == set(ref.eos)


def test_tokenizer_from_gguf_encodes_as_the_reference(ref):
    tokenizer = load_tokenizer(ref.gguf("f32"))
    for text in TEXTS:
        assert tokenizer.encode(text) == ref.tokenizer.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = [{"role": "user", "content": "parse the header"}]
    assert (tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == ref.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert tokenizer.eos_token == EOS


def test_q8_0_gguf_dequantizes_within_its_rounding(ref):
    """Q8_0 (a block of 32 int8 values and one scale): each weight within one step of its block's scale of
    the reference weight (a q/k permutation not undone would be off by the weights' own size), and the
    logits close."""
    model = load_model(ref.gguf("q8_0", qtype=gguf.GGMLQuantizationType.Q8_0))
    reference = ref.model.state_dict()
    for name, weight in model.state_dict().items():
        step = reference[name].abs().max() / 127
        assert (weight - reference[name]).abs().max() <= step, name
    assert any(not torch.equal(w, reference[n]) for n, w in model.state_dict().items()), "nothing was quantized"
    ids = ref.prompts()[0]
    got, want = logits(model, ids), logits(ref.model, ids)
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item()), (got - want).abs().max()


# --- converted once, into the cache, keyed by the file's hash ------------------------------------------

def converted_folders(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir()) if cache.exists() else []


def test_converted_once_into_the_cache_keyed_by_hash(ref, cache, monkeypatch, tmp_path):
    path = ref.gguf("f32")
    load_tokenizer(path)
    [folder] = converted_folders(cache)
    assert folder.name.startswith(gguf_sha256(path)[:20])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}

    monkeypatch.setattr("specdec.gguf.convert", refuse_to_convert)
    load_model(path)  # from the cache
    assert converted_folders(cache) == [folder]


def gguf_sha256(path: str) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def refuse_to_convert(file, out, *args, **kwargs):
    raise AssertionError(f"converted again: {file} -> {out}")


def test_a_changed_file_is_converted_to_another_folder(ref, cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(Path(ref.gguf("f32")).read_bytes())
    load_tokenizer(str(path))
    path.write_bytes(Path(ref.gguf("q8_0", qtype=gguf.GGMLQuantizationType.Q8_0)).read_bytes())
    load_tokenizer(str(path))
    names = [folder.name for folder in converted_folders(cache)]
    assert sorted(names) == sorted(f"{gguf_sha256(ref.gguf(n))[:20]}-v{FORMAT}" for n in ("f32", "q8_0"))


# --- refused, naming the file and why ------------------------------------------------------------------

def test_missing_gguf_file(tmp_path):
    missing = str(tmp_path / "nowhere.gguf")
    with pytest.raises(FileNotFoundError, match="nowhere.gguf' does not exist"):
        load_model(missing)


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("<html>a download page, not a model</html>")
    with pytest.raises(ValueError, match="model.gguf' is not a GGUF file"):
        load_tokenizer(str(path))


@pytest.mark.parametrize("keep", [0.5, 0.02], ids=["tensors cut", "header cut"])
def test_a_truncated_gguf(ref, tmp_path, cache, keep):
    data = Path(ref.gguf("f32")).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="cut.gguf' is not a readable GGUF file") as e:
        load_model(str(path))
    assert not isinstance(e.value, UnsupportedModel)
    assert converted_folders(cache) == []


def test_an_architecture_transformers_cannot_read(ref, tmp_path):
    path = write_gguf(tmp_path / "rwkv.gguf", ref.model, ref.tokenizer_model, architecture="rwkv6")
    with pytest.raises(UnsupportedModel, match="rwkv6") as e:
        load_model(str(path))
    assert "rwkv.gguf" in str(e.value) and "transformers cannot read" in str(e.value)


def test_a_quantization_transformers_cannot_dequantize(ref, tmp_path, cache):
    """Q8_1: llama.cpp's type for intermediate activations, which neither gguf nor transformers dequantizes."""
    path = write_gguf(tmp_path / "q8_1.gguf", ref.model, ref.tokenizer_model, qtype=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(UnsupportedModel, match="cannot dequantize") as e:
        load_model(str(path))
    assert "q8_1.gguf" in str(e.value) and "Q8_1" in str(e.value)
    assert converted_folders(cache) == []


# --- decoded by specdec: greedy equals the reference's generate() ------------------------------------

def test_engine_greedy_on_the_gguf_model_equals_reference_generate(ref, from_gguf):
    prompts, references = [], []
    for prompt in ref.prompts():
        tokens, gap = hf_greedy_margin(ref.model, prompt, NEW_TOKENS)
        if gap >= MIN_GAP:
            prompts.append(prompt)
            references.append(tokens)
    assert len(prompts) >= 3, "too many near-ties"
    engine = SpeculativeEngine(CachedLM(from_gguf), make_drafter("ngram", None, 1), SpecConfig(depth=3),
                               eos_token_ids=set())
    for out, want in zip(engine.generate(prompts, NEW_TOKENS), references):
        assert out.token_ids == want


def test_specdec_generate_with_a_gguf_target(ref, capsys):
    main(["generate", "--target", ref.gguf("f32"), "--drafter", "ngram", "--prompt", PROMPT,
          "--max-new-tokens", "8", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == hf_greedy(ref.model, ref.tokenizer.encode(PROMPT), 8, ref.eos)
    assert out["text"] == ref.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


@pytest.mark.timeout(300)
def test_specdec_serve_with_a_gguf_target(ref, tmp_path):
    """`specdec serve --target model.gguf` (a real process, its own Ray cluster) answers as the reference."""
    grpc_port, http_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "tools.commands", "serve", "--target", ref.gguf("f32"), "--drafter", "ngram",
             "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        reply = first_reply(server, f"127.0.0.1:{grpc_port}", log)
        assert list(reply.token_ids) == hf_greedy(ref.model, ref.tokenizer.encode(PROMPT), 8, ref.eos)
        stop_cleanly(server, log)
    finally:
        kill_if_running(server)


# --- a header that claims more than the file holds, or a bad architecture: refused before gguf reads it --------

def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def write_header(path: Path, kvs: list[bytes], tensor_count: int = 0, kv_count: int | None = None) -> str:
    """A GGUF file of a header alone (version 3), its key-value pairs written as given -> its path."""
    counts = struct.pack("<IQQ", 3, tensor_count, len(kvs) if kv_count is None else kv_count)
    path.write_bytes(b"GGUF" + counts + b"".join(kvs))
    return str(path)


ARCH = gguf_string(b"general.architecture") + struct.pack("<I", 8) + gguf_string(b"llama")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kvs, counts, words", [
    ([gguf_string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 4, 2**40) + bytes(64)], {},
     "the item count of tokenizer.ggml.tokens is 1099511627776, at least 4398046511104 bytes"),
    ([ARCH], dict(kv_count=2**40), "kv_count is 1099511627776"),
    ([ARCH], dict(tensor_count=2**40), "tensor_count is 1099511627776"),
    ([struct.pack("<Q", 2**62) + b"general"], {}, "a key's length is 4611686018427387904"),
], ids=["array items", "keys", "tensors", "key length"])
def test_a_header_claiming_more_than_the_file_holds(tmp_path, cache, kvs, counts, words):
    path = write_header(tmp_path / "huge.gguf", kvs, **counts)
    with pytest.raises(ValueError, match="huge.gguf' is not a readable GGUF file") as e:
        load_model(path)
    assert words in str(e.value) and "bytes left" in str(e.value)
    assert converted_folders(cache) == []


@pytest.mark.parametrize("value, words", [
    (struct.pack("<I", 4) + struct.pack("<I", 0x616D616C), "a UINT32 field"),  # "lama" as a number
    (struct.pack("<I", 8) + gguf_string(b"\xff\xfe"), "a STRING field"),  # not UTF-8
], ids=["uint32", "not utf-8"])
def test_an_architecture_that_is_no_string(tmp_path, value, words):
    path = write_header(tmp_path / "arch.gguf", [gguf_string(b"general.architecture") + value])
    with pytest.raises(ValueError, match="arch.gguf' is not a readable GGUF file: its general.architecture") as e:
        load_model(path)
    assert words in str(e.value)
