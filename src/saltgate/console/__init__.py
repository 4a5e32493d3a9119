"""The web console on the admin listener (/console/): saltgate.console.app.Console."""
