"""Trainium plumbing of a trial (see :mod:`sweep.neuron.launch` until the module is split by job)."""

from sweep.neuron.launch import *  # noqa: F403
