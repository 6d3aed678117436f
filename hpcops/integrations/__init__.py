"""Framework integrations. Each lives in its own subpackage and imports its framework lazily; the
hpcops core never imports a serving framework."""
