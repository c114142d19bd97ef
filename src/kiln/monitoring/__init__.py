"""Watching a server over time: history (SQLite), the PromQL subset, alert rules, alerts and
their notifications, the live view and the fleet, and their ``/api`` routes.

Everything here reads what ``kiln.metrics`` exports (the same collectors ``/metrics``
serves), so a rule, a history query and a Prometheus scrape see the same series.
"""
