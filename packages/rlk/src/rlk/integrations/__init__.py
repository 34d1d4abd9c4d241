"""Thin adapters that map a trainer's conventions onto rlk's ops, each tested against the real package.

Import one explicitly (``import rlk.integrations.verl``); this package imports no trainer, and ``import rlk``
does not import it.
"""
