"""GGUF files (llama.cpp's format, the way most small models ship) as a model path: a `.gguf` file is
dequantized by transformers once, saved as a safetensors folder in the cache keyed by the file's hash,
and every later load reads that folder. A file transformers cannot read is refused naming why."""

import fcntl
import hashlib
import os
import shutil
import struct
from contextlib import contextmanager, suppress
from pathlib import Path

from .cache_dir import cache_root
from .errors import UnsupportedModel

GGUF_MAGIC = b"GGUF"
# GGUF's value types (gguf's GGUFValueType): the byte size of each scalar one, and the two that are not scalars
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MIN_KV_SIZE = 8 + 4 + 1  # a key's length, its value's type, the smallest value
MIN_TENSOR_INFO_SIZE = 8 + 4 + 4 + 8  # a name's length, its dimension count, its type, its offset
SUFFIX = ".gguf"
FORMAT = 1  # bump when the conversion changes what it writes


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(SUFFIX)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


_HASHES: dict[tuple[str, int, int], str] = {}  # (resolved path, size, mtime) -> sha256, per process


def _hash_of(file: Path) -> str:
    """The file's sha256, hashed once per process for one version of a file (a load asks three times)."""
    st = file.stat()
    key = (str(file.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = file_sha256(file)
    return _HASHES[key]


def check_gguf_file(path: Path) -> None:
    """FileNotFoundError / ValueError naming the file when it is missing or is not a GGUF file."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


def model_folder(path: str, root: Path | None = None, log=None) -> str:
    """The transformers folder to load for a model path: the path itself, or for a `.gguf` file its
    converted folder in the cache (converted on first use)."""
    if not is_gguf(path):
        return path
    file = Path(path).expanduser()
    check_gguf_file(file)
    out = (root or cache_root()) / "gguf" / f"{_hash_of(file)[:20]}-v{FORMAT}"
    with _locked(out.with_name(out.name + ".lock")):  # two actors on one node convert it once
        if not (out / "config.json").exists():
            if log is not None:
                log(f"specdec: converting {file.name} (GGUF) once into {out}")
            convert(file, out)
    return str(out)


def convert(file: Path, out: Path, eos_token_ids: list[int] | None = None) -> None:
    """Dequantize a GGUF file to float32 and save it with its tokenizer (and chat template) as a
    safetensors folder at `out` (atomically). `eos_token_ids`: the generation's stop tokens, if not the file's.
    UnsupportedModel when transformers cannot read the file's architecture or quantization, or specdec
    cannot decode the model exactly (specdec.supported.check_supported); ValueError naming a truncated or
    corrupt file."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError:
        raise ValueError("reading a GGUF file needs the `gguf` package: pip install gguf") from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .supported import check_supported

    architecture = _gguf_architecture(file)
    where = dict(pretrained_model_name_or_path=str(file.parent), gguf_file=file.name)
    try:
        config = AutoConfig.from_pretrained(**where)
    except (ValueError, KeyError, RuntimeError) as e:
        raise UnsupportedModel(architecture, f"transformers cannot read the GGUF file {str(file)!r} ({e})") from None
    check_supported(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        loaded = AutoModelForCausalLM.from_pretrained(**where)
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
        raise UnsupportedModel(config.model_type,
                               f"transformers cannot dequantize the GGUF file {str(file)!r} ({e})") from None
    # A model loaded from GGUF refuses save_pretrained ("quantized with gguf"): its weights go into a plain one.
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    if eos_token_ids is not None:
        model.generation_config.eos_token_id = eos_token_ids
    tmp = out.with_name(out.name + f".converting-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _gguf_architecture(file: Path) -> str:
    """The file's general.architecture ("unknown" when it has none); ValueError naming the file when gguf's
    reader cannot parse it (truncated or corrupt), before transformers fails on it less clearly."""
    from gguf import GGUFReader, GGUFValueType

    check_header(file)
    try:
        fields = GGUFReader(file).fields
    except Exception as e:  # noqa: BLE001 (struct.error, ValueError, IndexError ... from a damaged file)
        raise ValueError(f"{str(file)!r} is not a readable GGUF file (truncated or corrupt? {type(e).__name__}: "
                         f"{e})") from None
    field = fields.get("general.architecture")
    if field is None:
        return "unknown"
    if field.types == [GGUFValueType.STRING]:
        with suppress(UnicodeDecodeError):
            return bytes(field.parts[field.data[0]]).decode()
    types = " of ".join(t.name for t in field.types)
    raise ValueError(f"{str(file)!r} is not a readable GGUF file: its general.architecture (a {types} field) is not a "
                     "UTF-8 string")


def check_header(file: Path) -> None:
    """Walk the file's header (GGUF's layout: gguf's gguf_reader.py) and refuse a count of keys, tensors,
    bytes or array items that claims more bytes than the file has left, which gguf's reader would loop over
    item by item, unbounded: ValueError naming the file, the key and the numbers."""
    with open(file, "rb") as f:
        header = _Header(f, file)
        if f.read(4) != GGUF_MAGIC:
            header.refuse(f"it does not start with {GGUF_MAGIC!r}")
        if header.number("I") & 0xFFFF == 0:  # the version, written big-endian (as gguf's reader tells)
            header.order = ">"
        tensors, kvs = header.number("Q"), header.number("Q")
        for _ in range(header.count("kv_count", kvs, MIN_KV_SIZE)):
            key = header.key()
            header.skip_value(key, header.number("I"))
        header.count("tensor_count", tensors, MIN_TENSOR_INFO_SIZE)


class _Header:
    """A GGUF header read in order: its numbers and keys read, its values skipped, each count checked against
    the bytes the file has left."""

    def __init__(self, f, file: Path):
        self.f, self.file, self.size, self.order = f, file, file.stat().st_size, "<"

    def refuse(self, why: str):
        raise ValueError(f"{str(self.file)!r} is not a readable GGUF file (truncated or corrupt? {why})")

    def number(self, fmt: str) -> int:
        raw = self.f.read(struct.calcsize(fmt))
        if len(raw) < struct.calcsize(fmt):
            self.refuse(f"its header ends with the file, at byte {self.size}")
        return struct.unpack(self.order + fmt, raw)[0]

    def count(self, what: str, n: int, each: int) -> int:
        """n, unless n items of at least `each` bytes do not fit in the rest of the file."""
        left = self.size - self.f.tell()
        if n * each > left:
            self.refuse(f"{what} is {n}, at least {n * each} bytes, and the file has {left} bytes left")
        return n

    def key(self) -> str:
        return self.f.read(self.count("a key's length", self.number("Q"), 1)).decode(errors="replace")

    def skip_value(self, key: str, kind: int) -> None:
        if kind == STRING:
            self.f.seek(self.count(f"the length of {key}", self.number("Q"), 1), 1)
        elif kind == ARRAY:
            item, n = self.number("I"), self.number("Q")
            if item == STRING:
                for _ in range(self.count(f"the item count of {key}", n, 8)):
                    self.skip_value(key, STRING)
            elif item in SCALAR_SIZES:
                self.f.seek(self.count(f"the item count of {key}", n, SCALAR_SIZES[item]) * SCALAR_SIZES[item], 1)
            else:  # an array of arrays, which llama.cpp does not read either
                self.refuse(f"{key} is an array of value type {item}")
        elif kind in SCALAR_SIZES:
            self.f.seek(SCALAR_SIZES[kind], 1)
        else:
            self.refuse(f"{key} has the unknown value type {kind}")


@contextmanager
def _locked(lock: Path):
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
