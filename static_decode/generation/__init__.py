"""The host side above capture/: the generator's request loop, conversations, the prefix cache."""
