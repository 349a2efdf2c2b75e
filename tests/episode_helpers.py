"""Importable by module:name from tests and their sandbox workers: reward functions that read an
episode's record, and an environment that owns its reward (``gspo.envs`` imported only when it is
built: a reward sandbox imports this module with its network functions replaced)."""


class ParityEnv:
    """Ends after the first turn; its own reward is the turn's first character's parity (the
    reward ``first_char_parity`` of the test rewards gives a single-turn completion)."""

    def __init__(self, example):
        self.turn = None

    def step(self, turn):
        from gspo.envs import Reply
        self.turn = turn.text
        return Reply(None, info={"seen": turn.text})

    def reward(self) -> float:
        return float(ord(self.turn[0]) % 2) if self.turn else 0.0


def calls_made(completion, transcript, tool_calls, **row):
    """1 per tool call the episode made, plus 10 per assistant turn (reads the record)."""
    return len(tool_calls) + 10 * sum(m["role"] == "assistant" for m in transcript)


def info_seen(completion, info, **row):
    """The length of what the environment kept under ``seen`` (reads the record's info)."""
    return float(len(info.get("seen", "")))


def plain(completion, **row):
    """Takes only **row: gets no record field, whatever the episode."""
    return float(sorted(row) == ["answer", "prompt"])
