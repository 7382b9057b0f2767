"""Message content as both APIs send it: a string, or a list of parts of which only text parts are served."""
from __future__ import annotations

from stratad.gateway.errors import ApiError


def text_of(content, where: str) -> str:
    """The text of content (None: ""), its text parts joined by newlines as vLLM does; any other part is a 400
    naming it (where: the content's path in the request)."""
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError("invalid_request", f"{where}[{j}].type: {part.get('type')!r} is not supported here (text "
                           "parts only)", f"{where}[{j}].type")
        out.append(part["text"])
    return "\n".join(out)
