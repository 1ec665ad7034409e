# Sourced by tools/gpu_*.sh: the options every GPU script shares, taken out of its arguments.
#   --out DIR    where logs and results go (default: $OUT if set, else ./gpu_out); created if missing
#   --install    first install this checkout (pip install --no-deps -e .) and, if .whl/ holds wheels
#                (tools/offline_wheels.sh, for machines without a package index), those into /tmp/site
# Without --install nothing is installed: the script checks that trace_lightning imports and stops with a hint.
OUT=${OUT:-./gpu_out}
INSTALL=0
_rest=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    --install) INSTALL=1; shift ;;
    *) _rest+=("$1"); shift ;;
  esac
done
set -- "${_rest[@]}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "$INSTALL" = 1 ]; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >"$OUT/wheels.log" 2>&1 || { tail -5 "$OUT/wheels.log"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -5 "$OUT/install.log"
elif [ -d /tmp/site ] && compgen -G ".whl/*.whl" > /dev/null; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # installed by an earlier --install call
fi
python3 -c "import trace_lightning, jsonargparse" 2>/dev/null || {
  echo "trace_lightning (or its dependencies) does not import: run 'pip install -e .' first, or pass --install" \
       "(offline machine: bash tools/offline_wheels.sh on a connected one, carry .whl/, then --install)" >&2
  exit 2
}
