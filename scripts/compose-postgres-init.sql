-- compose.yaml's PostgreSQL, made like the development machines': a superuser `root` with
-- its own database, so a bare `psql -h 127.0.0.1` run as root connects as on those.
CREATE ROLE root SUPERUSER LOGIN;
CREATE DATABASE root OWNER root;
