"""The admin page's template rendered as :class:`gpupool.hub.pages.AdminPage` renders it, with
JupyterHub's ``page.html`` stubbed, for tests that build the view themselves (no hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

TEMPLATES = Path(__file__).resolve().parents[1] / "hub" / "gpupool" / "hub" / "templates"


def render_admin(view: dict[str, Any]) -> str:
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(
            [
                jinja2.FileSystemLoader(str(TEMPLATES)),
                jinja2.DictLoader({"page.html": "{% block main %}{% endblock %}"}),
            ]
        ),
        autoescape=True,
    )
    return env.get_template("gpupool-admin.html").render(
        view=view, flash="", base_url="/hub/", xsrf="T", pool_admin=True
    )
