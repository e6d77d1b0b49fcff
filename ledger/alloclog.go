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
	"strconv"
	"time"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/stateformat"
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
	// open opens the file for appending: os.OpenFile, or a test's
	// stand-in whose writes fail as a full state dir's do.
	open openFunc
	f    LogFile
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

// LogFile is the allocation log opened for appending: what the log does
// with an *os.File.
type LogFile interface {
	Write(b []byte) (int, error)
	Truncate(size int64) error
	Close() error
}

// openFunc opens path, which exists, for appending.
type openFunc func(path string) (LogFile, error)

// openAppend is the default openFunc.
func openAppend(path string) (LogFile, error) {
	return os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
}

// allocLogFormat is the records' format. A record names its version only
// when it is not 1.0, the format of the agents before records carried one,
// so that such an agent, rolled back to, still reads what this one wrote
// while nothing was added.
var allocLogFormat = stateformat.Format{Reads: []stateformat.Version{{Major: 1, Minor: 0}}, Unversioned: stateformat.Version{Major: 1}}

// allocRecordVersion is the version of the records this build writes,
// as they name it (0, 0: unnamed, 1.0).
func allocRecordVersion() (major, minor int) {
	v := allocLogFormat.Current()
	if v == allocLogFormat.Unversioned {
		return 0, 0
	}
	return v.Major, v.Minor
}

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
	if rec.Version != 0 {
		b = append(b, `,"version":`...)
		b = strconv.AppendInt(b, int64(rec.Version), 10)
	}
	if rec.Minor != 0 {
		b = append(b, `,"minor":`...)
		b = strconv.AppendInt(b, int64(rec.Minor), 10)
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
// replicas of a shared device, in format Version.Minor (allocLogFormat;
// both 0: 1.0). Resource and Replicas came later: a record without them
// (an older agent's) is read as devices whose name is unknown.
type allocRecord struct {
	At       time.Time `json:"at"`
	IDs      []string  `json:"ids"`
	Version  int       `json:"version,omitempty"`
	Minor    int       `json:"minor,omitempty"`
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
func newAllocLog(dir string, log *slog.Logger, write writeFunc, open openFunc) *allocLog {
	if open == nil {
		open = openAppend
	}
	return &allocLog{path: filepath.Join(dir, AllocLogFile), log: log, write: write, open: open}
}

// readBack reads what the log holds. A log that cannot be read (not a
// regular file, too large) is set aside, and setAside says so; lines that
// cannot be decoded (the torn last line of a crash) are skipped with a
// warning. err says the log could be neither read nor set aside, or that
// it holds a record of a newer major format (a *stateformat.NewerError):
// then it is left as it is, for the newer agent that wrote it.
func (l *allocLog) readBack() (entries map[string]AllocEntry, setAside, err error) {
	b, err := atomicfile.ReadFile(l.path, maxAllocLogBytes)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return map[string]AllocEntry{}, nil, nil
	case err != nil:
		aside, err := atomicfile.SetAside(l.path, err)
		if aside == "" {
			return nil, nil, fmt.Errorf("allocation log %w", err)
		}
		return map[string]AllocEntry{}, fmt.Errorf("allocation log %w, allocations made before this start are known only from the kubelet", err), nil
	}
	entries, bad, err := DecodeAllocLog(b)
	if err != nil {
		return nil, nil, fmt.Errorf("allocation log %s: %w; left as it is for the agent that wrote it (roll forward to it, or remove the file to start without the allocations it records)", l.path, err)
	}
	for _, e := range bad {
		l.log.Warn("allocation log: record skipped", "path", l.path, "error", e)
	}
	return entries, nil, nil
}

// isOpen reports whether records can be appended.
func (l *allocLog) isOpen() bool { return l.f != nil }

// DecodeAllocLog reads an allocation log: for each device, when and how it
// was last handed out. A line that is not a whole record is skipped and
// reported in bad. A record of a newer major format stops the reading:
// err (a *stateformat.NewerError) says which line.
func DecodeAllocLog(b []byte) (entries map[string]AllocEntry, bad []error, err error) {
	out := map[string]AllocEntry{}
	for i, line := range bytes.Split(b, []byte{'\n'}) {
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		rec, err := decodeAllocRecord(line)
		if newer := (*stateformat.NewerError)(nil); errors.As(err, &newer) {
			return nil, nil, fmt.Errorf("line %d: %w", i+1, err)
		}
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
	return out, bad, nil
}

// decodeAllocRecord reads one line of the log: strictly in a format this
// build knows, without the fields a newer minor format added.
func decodeAllocRecord(line []byte) (allocRecord, error) {
	var rec allocRecord
	if _, err := allocLogFormat.Decode(line, &rec); err != nil {
		return rec, err
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
	rec.Version, rec.Minor = allocRecordVersion()
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
		rec.Version, rec.Minor = allocRecordVersion()
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
	open := l.open
	if open == nil {
		open = openAppend
	}
	f, err := open(l.path)
	if err != nil {
		// The file open for appending was just replaced: a record
		// appended to it now would go to a file nobody reads. Not open,
		// the log refuses Allocate until it opens again.
		if l.f != nil {
			l.f.Close()
			l.f = nil
		}
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
