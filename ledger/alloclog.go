package ledger

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/gpu-agent/gpu-agent/atomicfile"
)

// AllocLogFile is the allocation log's name in --state-dir: one line per
// Allocate the device plugin answered, with the devices and when.
const AllocLogFile = "allocations.log"

// The limits of what the log holds and how it is read back.
const (
	// maxAllocLogBytes bounds the file read back; compaction keeps it far
	// below (compactAbove), so a larger file is not ours.
	maxAllocLogBytes = 4 << 20
	// compactAbove is the size from which settling allocations rewrites
	// the log with only those still unsettled.
	compactAbove = 64 << 10
	// maxRecordIDs and maxIDBytes bound one record: a node has at most a
	// few hundred devices, each named by a UUID.
	maxRecordIDs = 4096
	maxIDBytes   = 256
)

// allocLog makes each device plugin allocation durable before Allocate
// answers, by one write(2) of one line to a file opened for appending: no
// fsync. The line is in the kernel's page cache before the kubelet hears
// the answer, so every crash of the agent (SIGKILL, OOM kill, panic) keeps
// it and the restarted agent reads it back. Only a crash of the machine
// could lose it, and that takes with it what the record protects: the
// containers, and the MIG devices themselves (GPU instances do not survive
// a reboot), so nothing is left to be destroyed by mistake. An fsync per
// Allocate would put milliseconds of disk latency on the kubelet's
// container start for no such case. Compaction rewrites the file through
// atomicfile (fsync, rename) when settled records make it large. Methods
// are called under the ledger's lock.
type allocLog struct {
	path string
	// write replaces a file atomically: atomicfile.Write (nil), or a
	// test's stand-in that fails as a full or read-only state dir would.
	write writeFunc
	f     *os.File
	// size is the length of the whole records in the file: a failed write
	// is cut back to it, so a torn line never prefixes the next record.
	size int64
	log  *slog.Logger
	// buf is reused for each record: Allocate is on the kubelet's
	// container start path.
	buf []byte
	// read is set once what the file held at start is in the ledger: a
	// retried open does not read the file it rewrites again. closed is
	// set by close: the log is not opened again.
	read, closed bool
}

// writeFunc is atomicfile.Write's signature.
type writeFunc func(path string, data []byte, opts ...atomicfile.Options) error

// appendRecord appends one record and its newline to b: the JSON that
// json.Marshal makes of rec, written by hand for the IDs the catalog has
// (UUIDs: no character JSON escapes), which keeps Allocate's cost down;
// any other string goes through encoding/json.
func appendRecord(b []byte, rec allocRecord) ([]byte, error) {
	b = append(b, `{"at":"`...)
	b = rec.At.AppendFormat(b, time.RFC3339Nano)
	b = append(b, `","ids":`...)
	b, err := appendStrings(b, rec.IDs)
	if err != nil {
		return nil, err
	}
	if rec.Resource != "" {
		b = append(b, `,"resource":`...)
		if b, err = appendString(b, rec.Resource); err != nil {
			return nil, err
		}
	}
	if len(rec.Replicas) > 0 {
		b = append(b, `,"replicas":`...)
		if b, err = appendStrings(b, rec.Replicas); err != nil {
			return nil, err
		}
	}
	return append(b, "}\n"...), nil
}

// appendStrings appends ss as a JSON array.
func appendStrings(b []byte, ss []string) ([]byte, error) {
	b = append(b, '[')
	for i, x := range ss {
		if i > 0 {
			b = append(b, ',')
		}
		var err error
		if b, err = appendString(b, x); err != nil {
			return nil, err
		}
	}
	return append(b, ']'), nil
}

// appendString appends x as a JSON string.
func appendString(b []byte, x string) ([]byte, error) {
	if plainID(x) {
		return append(append(append(b, '"'), x...), '"'), nil
	}
	q, err := json.Marshal(x)
	if err != nil {
		return nil, err
	}
	return append(b, q...), nil
}

// plainID reports whether id needs no JSON escaping and no HTML-safe
// escaping either (json.Marshal escapes <, > and &).
func plainID(id string) bool {
	for i := range len(id) {
		c := id[i]
		if c < 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return true
}

// allocRecord is one line of the log: the devices (GPU or MIG UUIDs) one
// Allocate handed out, when, under which resource, and which of them as
// replicas of a shared device. Resource and Replicas came later: a record
// without them (an older agent's) is read as devices whose name is unknown.
type allocRecord struct {
	At       time.Time `json:"at"`
	IDs      []string  `json:"ids"`
	Resource string    `json:"resource,omitempty"`
	Replicas []string  `json:"replicas,omitempty"`
}

// AllocEntry is what the ledger keeps of a device the device plugin handed
// out: when, under which resource ("" when an older log did not say), and
// whether as a replica of a shared device.
type AllocEntry struct {
	At       time.Time
	Resource string
	Replica  bool
}

// newAllocLog is dir's allocation log, neither read nor open yet (the
// ledger's openLogLocked does both).
func newAllocLog(dir string, log *slog.Logger, write writeFunc) *allocLog {
	return &allocLog{path: filepath.Join(dir, AllocLogFile), log: log, write: write}
}

// readBack reads what the log holds. A log that cannot be read (not a
// regular file, too large) is set aside, and setAside says so; lines that
// cannot be decoded (the torn last line of a crash) are skipped with a
// warning. err says the log could be neither read nor set aside.
func (l *allocLog) readBack() (entries map[string]AllocEntry, setAside, err error) {
	b, err := atomicfile.ReadFile(l.path, maxAllocLogBytes)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return map[string]AllocEntry{}, nil, nil
	case err != nil:
		aside := l.path + ".unreadable"
		if rerr := os.Rename(l.path, aside); rerr != nil {
			return nil, nil, fmt.Errorf("allocation log %s: %w (and setting it aside: %w)", l.path, err, rerr)
		}
		return map[string]AllocEntry{}, fmt.Errorf("allocation log %s: %w; set aside as %s, allocations made before this start are known only from the kubelet", l.path, err, aside), nil
	}
	entries, bad := DecodeAllocLog(b)
	for _, e := range bad {
		l.log.Warn("allocation log: record skipped", "path", l.path, "error", e)
	}
	return entries, nil, nil
}

// isOpen reports whether records can be appended.
func (l *allocLog) isOpen() bool { return l.f != nil }

// DecodeAllocLog reads an allocation log: for each device, when and how it
// was last handed out. A line that is not a whole record is skipped and
// reported.
func DecodeAllocLog(b []byte) (map[string]AllocEntry, []error) {
	out := map[string]AllocEntry{}
	var bad []error
	for i, line := range bytes.Split(b, []byte{'\n'}) {
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		rec, err := decodeAllocRecord(line)
		if err != nil {
			if len(bad) < 10 {
				bad = append(bad, fmt.Errorf("line %d: %w", i+1, err))
			}
			continue
		}
		for _, id := range rec.IDs {
			if old, ok := out[id]; !ok || rec.At.After(old.At) {
				out[id] = AllocEntry{At: rec.At, Resource: rec.Resource, Replica: slices.Contains(rec.Replicas, id)}
			}
		}
	}
	return out, bad
}

func decodeAllocRecord(line []byte) (allocRecord, error) {
	var rec allocRecord
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rec); err != nil {
		return rec, err
	}
	if dec.More() {
		return rec, errors.New("data after the record")
	}
	switch {
	case rec.At.IsZero():
		return rec, errors.New("no time")
	case len(rec.IDs) == 0 || len(rec.IDs) > maxRecordIDs:
		return rec, fmt.Errorf("%d device IDs", len(rec.IDs))
	}
	for _, id := range rec.IDs {
		if id == "" || len(id) > maxIDBytes {
			return rec, fmt.Errorf("device ID of %d bytes", len(id))
		}
	}
	if len(rec.Resource) > maxIDBytes {
		return rec, fmt.Errorf("resource name of %d bytes", len(rec.Resource))
	}
	for _, id := range rec.Replicas {
		if !slices.Contains(rec.IDs, id) {
			return rec, fmt.Errorf("replica %q is not among the record's devices", id)
		}
	}
	return rec, nil
}

// append writes one record. On a failed or short write the file is cut back
// to its whole records.
func (l *allocLog) append(rec allocRecord) error {
	line, err := appendRecord(l.buf[:0], rec)
	if err != nil {
		return err
	}
	l.buf = line
	n, err := l.f.Write(line)
	if err != nil {
		if n > 0 {
			_ = l.f.Truncate(l.size)
		}
		return fmt.Errorf("allocation log %s: %w", l.path, err)
	}
	l.size += int64(n)
	return nil
}

// compactLocked rewrites the log with only entries once it has grown past
// compactAbove; a failure keeps the longer log, which is still right. A log
// not open is left to the ledger's retries (openLogLocked).
func (l *allocLog) compactLocked(entries map[string]AllocEntry) {
	if !l.isOpen() || l.size < compactAbove {
		return
	}
	if err := l.rewrite(entries); err != nil {
		l.log.Warn("allocation log not compacted; it keeps growing until it is", "path", l.path, "error", err)
	}
}

// rewrite replaces the file with one record per entry (atomically) and
// reopens it for appending.
func (l *allocLog) rewrite(entries map[string]AllocEntry) error {
	var buf bytes.Buffer
	for _, id := range slices.Sorted(maps.Keys(entries)) {
		e := entries[id]
		rec := allocRecord{At: e.At, IDs: []string{id}, Resource: e.Resource}
		if e.Replica {
			rec.Replicas = rec.IDs
		}
		line, err := json.Marshal(rec)
		if err != nil {
			return err
		}
		buf.Write(line)
		buf.WriteByte('\n')
	}
	write := l.write
	if write == nil {
		write = atomicfile.Write
	}
	if err := write(l.path, buf.Bytes(), atomicfile.Options{Perm: 0o600}); err != nil {
		return err
	}
	f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return err
	}
	if l.f != nil {
		l.f.Close()
	}
	l.f, l.size = f, int64(buf.Len())
	return nil
}

// close closes the file, for good.
func (l *allocLog) close() {
	l.closed = true
	if l.f != nil {
		l.f.Close()
		l.f = nil
	}
}
