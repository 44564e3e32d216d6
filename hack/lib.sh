# Shell helpers the hack/ benchmark scripts share; source it after defining die().

# freeport: a loopback port below the ephemeral range that nothing accepts on now
freeport() {
  local p
  for _ in $(seq 200); do
    p=$((20000 + RANDOM % 12000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
  die "no free port"
}
