#!/usr/bin/env bash
# Runs a command as on a machine without MariaDB's client development files: its
# pkg-config files (mysqlclient, libmariadb, mariadb) and `mysql_config`/`mariadb_config`
# out of reach, every other library as it is. mysqlclient-sys's build script panics
# there ("Did not find a compatible version of libmysqlclient"), so whatever builds under
# it does not link MariaDB's client.
set -euo pipefail
hidden="$(mktemp -d)"
trap 'rm -rf "$hidden"' EXIT
mkdir "$hidden/pkgconfig" "$hidden/bin"
for dir in /usr/lib/x86_64-linux-gnu/pkgconfig /usr/lib/pkgconfig /usr/share/pkgconfig; do
    [ -d "$dir" ] || continue
    for pc in "$dir"/*.pc; do
        case "$(basename "$pc")" in
            mysqlclient.pc | libmariadb.pc | mariadb.pc) ;;
            *) ln -sf "$pc" "$hidden/pkgconfig/" ;;
        esac
    done
done
for tool in mysql_config mariadb_config; do
    printf '#!/bin/sh\necho "%s: hidden by %s" >&2\nexit 1\n' "$tool" "$0" >"$hidden/bin/$tool"
    chmod +x "$hidden/bin/$tool"
done
PKG_CONFIG_LIBDIR="$hidden/pkgconfig" PATH="$hidden/bin:$PATH" "$@"
