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

# build_at REV PKG OUT: builds PKG as it is at git revision REV into OUT, from a temporary
# worktree at OUT.src (drop_build OUT removes it; call it from the script's cleanup)
build_at() {
  local rev=$1 pkg=$2 out=$3
  git -C "$ROOT" worktree add --detach "$out.src" "$rev" >/dev/null 2>&1 || die "no worktree at $rev"
  (cd "$out.src" && go build -o "$out" "$pkg") || die "building $pkg at $rev failed"
}

# drop_build OUT: removes the worktree build_at left for OUT, if any
drop_build() {
  [ ! -d "$1.src" ] || git -C "$ROOT" worktree remove --force "$1.src" >/dev/null 2>&1 || true
}
