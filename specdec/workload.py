"""Workloads the benchmarks send, built from a prompt file (specdec.prompts).

single       every prompt once.
multi-turn   every prompt opens a conversation of `turns` turns: turn k's prompt is turn k-1's prompt,
             its output and a follow-up, as a chat client or an agent loop resends its whole context. A
             text row appends the output's tokens and the follow-up's; a chat row ('messages') adds the
             output as the assistant's message and the follow-up as the user's, rendered again by the
             target's chat template. The follow-ups are fixed (FOLLOW_UPS), the same for every run."""

import enum
from dataclasses import dataclass, field


class Workload(enum.StrEnum):
    SINGLE = "single"
    MULTI_TURN = "multi-turn"


# what a user or an agent sends after an answer, per task type (any other: "")
FOLLOW_UPS = {
    "code": ["Now fix any bugs in the code above and show the whole code again.",
             "Add a docstring and comments, and show the whole code again."],
    "": ["Say that again, more briefly.",
         "Go on, and repeat the main points first."],
}
DEFAULT_TURNS = 3


def follow_up(task_type: str, turn: int) -> str:
    """The follow-up sent after turn `turn` (1: after the first answer)."""
    texts = FOLLOW_UPS.get(task_type, FOLLOW_UPS[""])
    return texts[(turn - 1) % len(texts)]


@dataclass
class Conversation:
    """One prompt row as a conversation: the prompt of the turn to run next, as `text` (what a client
    sends) and as `ids` (its tokens; for a text row, the earlier turns' tokens exactly as generated)."""

    row: dict  # a load_prompts row: 'task_type', 'prompt' text, and 'messages' for a chat row
    text: str
    ids: list[int]
    turn: int = 1
    messages: list[dict] | None = field(default=None)

    @classmethod
    def open(cls, row: dict, tokenizer) -> "Conversation":
        messages = [dict(m) for m in row["messages"]] if "messages" in row else None
        return cls(row, row["prompt"], tokenizer(row["prompt"])["input_ids"], messages=messages)

    def answer(self, output: list[int], tokenizer) -> None:
        """This turn's output came back: the next turn's prompt resends the context with a follow-up."""
        follow = follow_up(self.row["task_type"], self.turn)
        said = tokenizer.decode(output, skip_special_tokens=True)
        if self.messages is None:
            added = "\n\n" + follow + "\n"
            self.text += said + added
            self.ids = self.ids + output + tokenizer(added, add_special_tokens=False)["input_ids"]
        else:
            self.messages += [{"role": "assistant", "content": said}, {"role": "user", "content": follow}]
            self.text = tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
            self.ids = tokenizer(self.text)["input_ids"]  # as the first turn's (and the bench's single prompts)
        self.turn += 1

    def request(self) -> dict:
        """This turn as a prompt row (what the served benchmark sends)."""
        return {"task_type": self.row["task_type"], "prompt": self.text}


def turns_of(workload: Workload | str, turns: int) -> int:
    """How many turns each prompt runs: 1 for single."""
    if turns < 1:
        raise ValueError(f"--turns must be >= 1, got {turns}")
    return 1 if Workload(workload) is Workload.SINGLE else turns
