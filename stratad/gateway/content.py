"""Message content as the APIs send it: a string, or a list of parts of which only text parts are served; and a
string field of a part or an item, checked as the schemas cannot (they take parts and items as plain objects)."""
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
        typ = part.get("type") if isinstance(part, dict) else None
        if not isinstance(typ, str) or typ not in kinds:
            what = repr(typ) if isinstance(part, dict) else f"a {type(part).__name__}, not a part,"
            raise ApiError("invalid_request", f"{where}[{j}].type: {what} is not supported here (text parts only)",
                           f"{where}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise ApiError("invalid_request", f"{where}[{j}].text: a {typ} part needs its text as a string",
                           f"{where}[{j}].text")
        out.append(part["text"])
    return "\n".join(out)


def string_field(obj: dict, key: str, where: str, default: str | None = ...) -> str | None:
    """obj[key], a string (default where it is absent; ...: required), else a 400 naming it (where: obj's path)."""
    v = obj.get(key, default)
    if v is ... or not (isinstance(v, str) or v is default):
        raise ApiError("invalid_request", f"{where}.{key}: expected a string", f"{where}.{key}")
    return v
