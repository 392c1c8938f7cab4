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
# Every directory pkg-config searches (its built-in path, for any architecture, and
# PKG_CONFIG_PATH, which would otherwise still be searched after PKG_CONFIG_LIBDIR).
IFS=: read -ra dirs <<<"$(pkg-config --variable pc_path pkg-config):${PKG_CONFIG_PATH:-}"
for dir in "${dirs[@]}"; do
    [ -d "$dir" ] || continue
    for pc in "$dir"/*.pc; do
        case "$(basename "$pc")" in
            mysqlclient.pc | libmariadb.pc | mariadb.pc) ;;
            *) [ -e "$pc" ] && ln -sf "$pc" "$hidden/pkgconfig/" ;;
        esac
    done
done
for tool in mysql_config mariadb_config; do
    printf '#!/bin/sh\necho "%s: hidden by %s" >&2\nexit 1\n' "$tool" "$0" >"$hidden/bin/$tool"
    chmod +x "$hidden/bin/$tool"
done
export PKG_CONFIG_LIBDIR="$hidden/pkgconfig" PATH="$hidden/bin:$PATH"
unset PKG_CONFIG_PATH
# A proof that proves nothing if the client can still be found: refuse to run then.
for lib in mysqlclient libmariadb; do
    if pkg-config --exists "$lib"; then
        echo "$0: pkg-config still finds $lib" >&2
        exit 1
    fi
done
"$@"
