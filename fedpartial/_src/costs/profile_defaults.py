"""The default device-profile distributions, without the device model itself: plain text that
:class:`~fedpartial.RunConfig` holds as its defaults without loading JAX (why these numbers:
:mod:`fedpartial._src.costs.devices`)."""

#: each client's compute speed (FLOP/s): median 5 GFLOP/s
DEFAULT_COMPUTE = "lognormal:5e9:0.7"
#: each client's download bandwidth (bytes/s): median 20 Mbit/s
DEFAULT_DOWNLOAD = "lognormal:2.5e6:0.8"
#: each client's upload bandwidth (bytes/s): median 5 Mbit/s
DEFAULT_UPLOAD = "lognormal:6.25e5:0.8"
