"""The dashboard page's static files, served at ``/dashboard`` on the HTTP port.

Plain HTML/JS/CSS plus uPlot vendored by ``build.sh`` into ``static/vendor/`` (committed,
so a checkout needs neither npm nor network).
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
