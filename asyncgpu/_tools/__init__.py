"""Tools built on the public face: the command line, the demo, the timeline
picture."""
