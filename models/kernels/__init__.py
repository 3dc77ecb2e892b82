"""Native CPU kernels of our own (C++, built with torch's extension tools on first use)."""
