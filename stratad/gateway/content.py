"""Message content as both APIs send it: a string, or a list of parts of which only text parts are served."""
from __future__ import annotations

from stratad.gateway.errors import ApiError


def text_of(content, where: str, kinds: frozenset[str] = frozenset({"text"})) -> str:
    """The text of content (None: ""), its text parts (of the types in kinds) joined by newlines as vLLM does; any
    other part is a 400 naming it (where: the content's path in the request)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError("invalid_request", f"{where}: expected a string or a list of parts", where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            typ = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError("invalid_request", f"{where}[{j}].type: {typ!r} is not supported here (text parts only)",
                           f"{where}[{j}].type")
        out.append(part["text"])
    return "\n".join(out)
