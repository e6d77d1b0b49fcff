package cdi

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// MigMinorsPath is where the NVIDIA driver lists the device minors of the
// MIG access capabilities (/dev/nvidia-caps/nvidia-cap<N>). procfs is not
// namespaced for it, so the agent's container reads the host's.
const MigMinorsPath = "/proc/driver/nvidia-caps/mig-minors"

// maxMigMinors bounds what is read: the driver's table has a line per GPU
// instance and compute instance of up to 32 GPUs, about 4,300 lines.
const maxMigMinors = 1 << 20

type capKey struct{ gpu, gi, ci int }

// MigMinors is the driver's MIG capability table.
type MigMinors map[capKey]int

// CapMinor implements CapMinors.
func (m MigMinors) CapMinor(gpuMinor, gi, ci int) (int, bool) {
	n, ok := m[capKey{gpuMinor, gi, ci}]
	return n, ok
}

// ReadMigMinors reads the table at path.
func ReadMigMinors(path string) (MigMinors, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("MIG capability table: %w", err)
	}
	defer f.Close()
	m, err := ParseMigMinors(f)
	if err != nil {
		return nil, fmt.Errorf("MIG capability table %s: %w", path, err)
	}
	return m, nil
}

// ParseMigMinors parses the driver's table: lines "gpu<G>/gi<I>/access <N>"
// and "gpu<G>/gi<I>/ci<C>/access <N>"; other capabilities ("config",
// "monitor") are skipped. A malformed line is an error naming it.
func ParseMigMinors(r io.Reader) (MigMinors, error) {
	m := MigMinors{}
	sc := bufio.NewScanner(io.LimitReader(r, maxMigMinors+1))
	read := 0
	for line := 1; sc.Scan(); line++ {
		read += len(sc.Bytes()) + 1
		if read > maxMigMinors {
			return nil, fmt.Errorf("larger than %d bytes", maxMigMinors)
		}
		text := strings.TrimSpace(sc.Text())
		if text == "" {
			continue
		}
		name, num, ok := strings.Cut(text, " ")
		if !ok {
			return nil, fmt.Errorf("line %d: %q: want \"<capability> <minor>\"", line, text)
		}
		minor, err := strconv.Atoi(strings.TrimSpace(num))
		if err != nil || minor < 0 {
			return nil, fmt.Errorf("line %d: %q: minor is not a number", line, text)
		}
		if !strings.HasPrefix(name, "gpu") {
			continue // config, monitor: not per instance
		}
		k, err := parseCapName(name)
		if err != nil {
			return nil, fmt.Errorf("line %d: %q: %w", line, text, err)
		}
		m[k] = minor
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return m, nil
}

// parseCapName parses "gpu0/gi1/access" (ci -1) and "gpu0/gi1/ci0/access".
func parseCapName(name string) (capKey, error) {
	parts := strings.Split(name, "/")
	if (len(parts) != 3 && len(parts) != 4) || parts[len(parts)-1] != "access" {
		return capKey{}, fmt.Errorf("capability %q is not gpu<G>/gi<I>[/ci<C>]/access", name)
	}
	num := func(s, prefix string) (int, error) {
		v, ok := strings.CutPrefix(s, prefix)
		if !ok {
			return 0, fmt.Errorf("capability %q: %q does not start with %q", name, s, prefix)
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("capability %q: %q is not %s<number>", name, s, prefix)
		}
		return n, nil
	}
	k := capKey{ci: -1}
	var err error
	if k.gpu, err = num(parts[0], "gpu"); err != nil {
		return capKey{}, err
	}
	if k.gi, err = num(parts[1], "gi"); err != nil {
		return capKey{}, err
	}
	if len(parts) == 4 {
		if k.ci, err = num(parts[2], "ci"); err != nil {
			return capKey{}, err
		}
	}
	return k, nil
}

// DriverNumbering is the numbering the NVIDIA driver gives MIG capabilities:
// after config (1) and monitor (2), each GPU has 15 GPU instances of one
// access minor followed by 8 compute-instance minors. A simulated node has
// no driver table; it uses this one so that its spec reads like a real
// node's.
type DriverNumbering struct{}

// CapMinor implements CapMinors.
func (DriverNumbering) CapMinor(gpuMinor, gi, ci int) (int, bool) {
	const gis, cis = 15, 8
	if gpuMinor < 0 || gi < 0 || gi >= gis || ci < -1 || ci >= cis {
		return 0, false
	}
	return 3 + gpuMinor*gis*(cis+1) + gi*(cis+1) + ci + 1, true
}
