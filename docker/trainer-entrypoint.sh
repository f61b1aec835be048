#!/bin/sh
# The agent reads its bearer token from TORCHVITALS_WEBHOOK_TOKEN only; a mounted secret file
# (TORCHVITALS_WEBHOOK_TOKEN_FILE, as the collector takes it) is exported here, so the token
# never appears in the image, the compose file or `docker inspect`.
set -eu
if [ -n "${TORCHVITALS_WEBHOOK_TOKEN_FILE:-}" ] && [ -z "${TORCHVITALS_WEBHOOK_TOKEN:-}" ]; then
    TORCHVITALS_WEBHOOK_TOKEN="$(cat "$TORCHVITALS_WEBHOOK_TOKEN_FILE")"
    export TORCHVITALS_WEBHOOK_TOKEN
fi
exec "$@"
