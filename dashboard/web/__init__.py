"""The web app: the Dash server and its security, the pages (one file each), components, figures, the
polling that keeps live pages current, and the offline HTML report."""
