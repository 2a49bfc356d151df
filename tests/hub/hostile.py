"""Hostile text for the hub tests, and how to tell that a page or a table survived it.

- :data:`HOSTILE`: text a user may store that has broken pages and terminals elsewhere (markup,
  quotes that leave an attribute or a script string, terminal escapes and other control
  characters, bidirectional overrides, invisible and astral characters, template syntax, 10 KB);
  :data:`UNSTORABLE`: what no page can hold, which every gpupool door refuses with 400;
  :data:`HOSTILE_TEXT`: a Hypothesis strategy of both, and of random runs of such characters.
- :func:`check_page`: a page is 200, UTF-8, without a traceback, and holds no element or event
  handler that such text made; :func:`gpupool` runs the real command, which must exit 0 without a
  traceback; :func:`safe_for_a_terminal`: its output has no control or bidirectional character
  left raw.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata

import requests
from bs4 import BeautifulSoup
from hypothesis import strategies as st

from tests.hub.conftest import Hub

HOSTILE = {
    "markup": '<script>alert("gp-markup")</script><img src=x onerror=alert(1)><b>bold</b>',
    "attribute": "\"' onmouseover=alert(2) x='",
    "script string": "');alert(3);//</script><script>alert(4)//",
    "entities": "&lt;b&gt; &amp;amp; &#60;i&#62;",
    "controls": "c\x01\x07\x08\x1b[2J\x1b]0;owned\x07\x1b[31m\r\t\x7f\x85\x9b",
    "newlines": "one\ntwo\r\nthree\u2028four",
    "bidi": "\u202egnp.exe\u202c \u2066x\u2069 \u200f\u061c\u200e",
    "invisible": "\u200b\u200d\ufeff\u00ad",
    "astral": "😀\U0010ffff\ufffe\uffff e\u0301",
    "templates": "{{7*7}} ${7*7} {% raw %} %s%n {0} %(x)s",
    "10 KB": "L" * 10_240,
}
UNSTORABLE = {"lone surrogate": "x\ud800y", "NUL": "x\0y"}
RAW_FOR_A_TERMINAL = {"\u061c", "\u200e", "\u200f", *map(chr, range(0x202A, 0x202F))} | {
    *map(chr, range(0x2066, 0x206A))
}
"""Bidirectional controls: a terminal (or an editor) reorders the text that follows them."""
HOSTILE_TEXT = st.one_of(
    st.sampled_from([*HOSTILE.values(), *UNSTORABLE.values()]),
    st.text(st.characters(categories=["Cc", "Cf", "Cs", "Co", "Zl", "Zp"]), min_size=1, max_size=8),
    st.text(
        st.sampled_from(["<", ">", "&", '"', "'", "\u202e", "\x1b", "\r", "\0"]),
        min_size=1,
        max_size=20,
    ),
)
"""Hostile text for a fuzzer: the samples above, and runs of control, format, surrogate and
private-use characters or of markup and escape characters."""

CONFIRM = re.compile(r'return confirm\("(?:[^"\\<>]|\\.)*"\)')
"""The only event handler gpupool's pages have: a confirmation with a JSON string."""


def check_page(r: requests.Response, what: str) -> BeautifulSoup:
    """``r`` is a page that holds the hostile values only as text (see the docstring)."""
    assert r.status_code == 200, f"{what}: {r.status_code} {r.text[-500:]}"
    text = r.content.decode("utf-8")  # strict: an unencodable character would be a 500 first
    assert "Traceback" not in text, what
    soup = BeautifulSoup(text, "html.parser")
    for tag in soup.find_all(True):
        assert tag.name != "img" or tag.get("src") != "x", f"{what}: {tag}"
        assert tag.name != "b" or tag.get_text() != "bold", f"{what}: {tag}"
        assert tag.name != "i" or tag.get_text() != "srv", f"{what}: {tag}"
        if tag.name == "script":
            assert "alert(" not in tag.get_text(), f"{what}: {tag}"
        for attribute, value in tag.attrs.items():
            if attribute.startswith("on"):
                assert (attribute, bool(CONFIRM.fullmatch(str(value)))) == ("onsubmit", True), (
                    f"{what}: {attribute}={value!r}"
                )
    return soup


def gpupool(hub: Hub, token: str, *args: str) -> str:
    """The real ``gpupool`` command's output: it exits 0, says nothing of a traceback."""
    env = {**os.environ, "JUPYTERHUB_API_URL": f"{hub.url}/hub/api", "JUPYTERHUB_API_TOKEN": token}
    done = subprocess.run(
        [sys.executable, "-m", "gpupool_lab.command", *args],
        env=env,
        capture_output=True,
        timeout=120,
    )
    out, err = done.stdout.decode("utf-8"), done.stderr.decode("utf-8", "replace")
    assert done.returncode == 0 and "Traceback" not in err, f"gpupool {args}: {err[-1500:]}"
    return out


def safe_for_a_terminal(text: str, what: str) -> None:
    """No character of ``text`` but line feeds moves a terminal's cursor or reorders text."""
    raw = sorted(
        {
            c
            for c in text
            if (unicodedata.category(c) in ("Cc", "Zl", "Zp") and c != "\n")
            or c in RAW_FOR_A_TERMINAL
        }
    )
    assert not raw, f"{what}: raw {[f'U+{ord(c):04X}' for c in raw]}"
