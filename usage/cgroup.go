package usage

import (
	"strings"
)

// Owner is what a process's cgroup says of where it runs.
type Owner struct {
	// PodUID is the UID of the pod, as the API server has it (with
	// dashes); empty for a process in no pod.
	PodUID string
	// ContainerID is the container's ID as the runtime names it (64 hex
	// digits), without the runtime's scheme; empty when the path names
	// none (a pod's own cgroup, or a conmon process).
	ContainerID string
	// Runtime is the runtime the cgroup's name shows: "containerd",
	// "cri-o" or "docker", as Kubernetes writes it before "://" in a
	// container status; empty under the cgroupfs driver, which names the
	// container by its ID alone.
	Runtime string
}

// scopePrefixes are the runtimes' names of a container's systemd scope
// ("<prefix><id>.scope") and what Kubernetes calls the runtime.
var scopePrefixes = [...]struct{ prefix, runtime string }{
	{"cri-containerd-", "containerd"},
	{"crio-", "cri-o"},
	{"docker-", "docker"},
}

// ParseCgroup reads the content of /proc/<pid>/cgroup: one line per
// hierarchy, "<id>:<controllers>:<path>" (cgroup v1 has one per controller,
// v2 the single line "0::<path>"). The first line whose path runs through a
// pod's cgroup gives the owner; a process in no pod may still be in a
// container. Paths are read relative to any root, as a reader in another
// cgroup namespace sees them ("/../../kubepods-…").
func ParseCgroup(content string) Owner {
	var loose Owner
	for line := range strings.Lines(content) {
		_, rest, ok := strings.Cut(strings.TrimRight(line, "\r\n"), ":")
		if !ok {
			continue
		}
		_, path, ok := strings.Cut(rest, ":")
		if !ok {
			continue
		}
		o := parsePath(path)
		if o.PodUID != "" {
			return o
		}
		if loose.ContainerID == "" {
			loose = o
		}
	}
	return loose
}

// parsePath finds the pod and container in one cgroup path. The pod's
// cgroup is named by the kubelet: "pod<uid>" under the cgroupfs driver,
// "<parent>-pod<uid with _ for ->.slice" under systemd (kubepods-pod…,
// kubepods-burstable-pod…, kubelet-kubepods-besteffort-pod…). The
// container's cgroup is within it: "<id>" (cgroupfs), or a scope of the
// runtime's ("cri-containerd-<id>.scope", "crio-<id>.scope"); in a path
// that names no pod, a scope is still a container's.
func parsePath(path string) Owner {
	var o Owner
	for c := range strings.SplitSeq(path, "/") {
		if o.PodUID == "" {
			if uid, ok := podComponent(c); ok {
				o.PodUID = uid
				continue
			}
		}
		if o.ContainerID != "" {
			continue
		}
		if id, runtime, ok := containerComponent(c, o.PodUID != ""); ok {
			o.ContainerID, o.Runtime = id, runtime
		}
	}
	return o
}

// podComponent reads a pod's cgroup name.
func podComponent(c string) (string, bool) {
	if base, ok := strings.CutSuffix(c, ".slice"); ok {
		i := strings.LastIndex(base, "-pod")
		if i < 0 {
			return "", false
		}
		uid := strings.ReplaceAll(base[i+len("-pod"):], "_", "-")
		return uid, podUID(uid)
	}
	if uid, ok := strings.CutPrefix(c, "pod"); ok && podUID(uid) {
		return uid, true
	}
	return "", false
}

// containerComponent reads a container's cgroup name: a runtime's scope,
// or under cgroupfs (inPod) the bare ID.
func containerComponent(c string, inPod bool) (id, runtime string, ok bool) {
	if base, isScope := strings.CutSuffix(c, ".scope"); isScope {
		for _, p := range scopePrefixes {
			if id, ok := strings.CutPrefix(base, p.prefix); ok && containerID(id) {
				return id, p.runtime, true
			}
		}
		return "", "", false
	}
	if inPod && containerID(c) {
		return c, "", true
	}
	return "", "", false
}

// podUID accepts the UIDs the kubelet names pods by: a UUID (lower-case
// hex in 8-4-4-4-12), or 32 hex digits for a static pod (a hash of its
// manifest).
func podUID(s string) bool {
	switch len(s) {
	case 32:
		return isHex(s)
	case 36:
		for i := range len(s) {
			if (s[i] == '-') != (i == 8 || i == 13 || i == 18 || i == 23) {
				return false
			}
		}
		return isHex(strings.ReplaceAll(s, "-", ""))
	}
	return false
}

// containerID accepts a runtime's container ID: 64 lower-case hex digits.
func containerID(s string) bool { return len(s) == 64 && isHex(s) }

func isHex(s string) bool {
	for i := range len(s) {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
