"""What `wt_trl.install()` sets for every client it makes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Settings", "settings"]


@dataclass
class Settings:
    """`replace_trainer`: take the server over from a trainer that is still alive (a
    restarted job whose old process hangs on); `timeout_s`: bounds every wait of a
    sync (the rendezvous, each call to the server, each transfer)."""

    replace_trainer: bool = False
    timeout_s: float = 300.0


settings = Settings()
