"""`cpumoe report`: a results database drawn as one static HTML page (PNG plots, tables) with Markdown/CSV exports.

    write.py    read the database, write everything below into the output directory
    cases.py    rows -> cases (repeats folded into median and range; machines kept apart; the layer skeleton)
    build.py    cases -> the page's sections: which figures, which tables
    figures.py  one function per figure kind (matplotlib Agg, 800x500 PNG)
    tables.py   the tables' columns per bench, and how a cell reads
    page.py     the sections as one HTML page (inline CSS, no script)
    export.py   the same tables as tables.md and csv/<table>.csv
"""
