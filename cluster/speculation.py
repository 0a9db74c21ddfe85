"""A request's speculation wish, without torch: the router follows it, and `specdec client` parses it
without importing the router's (torch) dependencies."""

import enum


class Speculation(enum.StrEnum):
    """The client's wish: follow the router, force speculation on, force it off. In the protos these
    are SPECULATION_<name> (specdec_api.proto); in the CLI and the HTTP API, either case."""

    AUTO = "AUTO"
    ON = "ON"
    OFF = "OFF"

    @classmethod
    def parse(cls, value: str, field_name: str = "speculation") -> "Speculation":
        """From a name in either case (HTTP, the CLI) or a proto enum name; ValueError naming the field."""
        name = value.removeprefix("SPECULATION_").upper() if isinstance(value, str) else None
        if name not in cls.__members__:  # a list or an object too (unhashable: a TypeError, not this error)
            raise ValueError(f"{field_name} must be one of {', '.join(cls.__members__)}, got {value!r}")
        return cls[name]

    @property
    def proto_name(self) -> str:
        return f"SPECULATION_{self.name}"
