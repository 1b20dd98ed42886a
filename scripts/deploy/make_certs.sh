#!/usr/bin/env bash
# A local certificate authority, the SuperLink's TLS certificate and one authentication key per
# SuperNode, for a trial federation (docs/federated.md, "Deployment"). Not for production: a real
# federation gets its certificate from the organisations' own CA and each silo makes its own key.
#
#   scripts/deploy/make_certs.sh OUT [NODES] [SUPERLINK_HOST]
#
# OUT/ca.crt, ca.key                 the CA (ca.key signs; keep it off the SuperLink)
# OUT/server.pem, server.key         the SuperLink's certificate (SAN: 127.0.0.1, localhost, SUPERLINK_HOST)
# OUT/node<i>, node<i>.pub           SuperNode i's ECDSA P-384 key pair (OpenSSH format, as Flower reads it)
set -euo pipefail
out=${1:?usage: make_certs.sh OUT [NODES] [SUPERLINK_HOST]}
nodes=${2:-3}
host=${3:-}
mkdir -p "$out"
cd "$out"
umask 077
openssl req -x509 -newkey rsa:3072 -nodes -keyout ca.key -out ca.crt -days 30 -sha256 \
    -subj "/CN=veil trial CA" 2>/dev/null
openssl req -newkey rsa:3072 -nodes -keyout server.key -out server.csr -subj "/CN=superlink" 2>/dev/null
san="subjectAltName=IP:127.0.0.1,DNS:localhost"
if [[ -n "$host" ]]; then
    if [[ "$host" =~ ^[0-9.]+$ ]]; then san="$san,IP:$host"; else san="$san,DNS:$host"; fi
fi
printf '%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
    "$san" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.pem -days 30 -sha256 \
    -extfile server.ext 2>/dev/null
rm -f server.csr server.ext ca.srl
for ((i = 0; i < nodes; i++)); do
    rm -f "node$i" "node$i.pub"
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "veil-node$i" -f "node$i"
done
chmod 644 ca.crt server.pem node*.pub
echo "wrote $(pwd): ca.crt server.pem server.key node0..node$((nodes - 1)) (+ .pub)"
