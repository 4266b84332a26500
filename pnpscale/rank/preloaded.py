"""Imported LAST by the forkserver that forks the local ranks (:data:`pnpscale.cluster.local.RANK_PRELOAD`):
every preload is in, so the launcher watch and the ignored SIGINT that :mod:`pnpscale.rank.forkserver`
installed first end here (:func:`pnpscale.rank.forkserver.preloaded`). Anywhere else: nothing."""

from __future__ import annotations

from pnpscale.rank.forkserver import preloaded

preloaded()
