"""One module per communication mode: its context, its Handle, its size hints and the kernel sequence
of each call. :class:`cuep.Buffer` checks arguments and streams, then hands each call to its mode;
what the modes of one Buffer share is a :class:`~cuep.modes.resources.Resources`."""
