"""`cpumoe report`: a results database drawn as one static HTML page (PNG plots, tables) with Markdown/CSV exports."""
