"""The simulated machine parts that let CI see what breaks on hardware and operating systems it does not have:
``platforms`` (Windows, 64 KiB-page arm64 Linux, macOS behind ``core.devices.host_memory``)."""
