package harness

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PodNamespace is the namespace of every static pod the suite writes.
const PodNamespace = "default"

// readyMarker is printed by a pod's container after its environment, so a reader knows the dump is complete.
const readyMarker = "E2E-READY"

// ReadyMarker ends the environment dump that PodContainerEnv reads: a pod of a test's own command prints its
// `KEY=value` lines, then this line.
const ReadyMarker = readyMarker

// PodSpec is a static pod with one busybox container that prints its environment and then sleeps.
type PodSpec struct {
	Name   string
	Limits map[string]int64 // extended resources, e.g. {"nvidia.com/gpu": 1}
}

// podManifest renders spec as the JSON the kubelet reads from its staticPodPath.
func podManifest(spec PodSpec) ([]byte, error) {
	limits := corev1.ResourceList{}
	for name, n := range spec.Limits {
		limits[corev1.ResourceName(name)] = *resource.NewQuantity(n, resource.DecimalSI)
	}
	pod := corev1.Pod{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Name: spec.Name, Namespace: PodNamespace},
		Spec:       envDumpPodSpec(limits, corev1.RestartPolicyNever),
	}
	return json.MarshalIndent(pod, "", "  ")
}

// envDumpPodSpec is a pod with one busybox container, "main", that prints its environment and readyMarker, then
// sleeps; limits are its extended resources.
func envDumpPodSpec(limits corev1.ResourceList, restart corev1.RestartPolicy) corev1.PodSpec {
	grace := int64(1) // the container's sleep ignores SIGTERM as PID 1; do not wait 30s for it on delete
	return corev1.PodSpec{
		// Host network: the node has no CNI, and the kubelet starts only host-network pods without one.
		HostNetwork:                   true,
		RestartPolicy:                 restart,
		TerminationGracePeriodSeconds: &grace,
		Containers: []corev1.Container{{
			Name:            "main",
			Image:           "docker.io/" + BusyboxImage,
			ImagePullPolicy: corev1.PullNever, // there is no registry; the image was imported
			// E2E_DEVICES: the GPU device nodes the container has (CDI scenarios check them).
			Command: []string{"sh", "-c", "env; echo E2E_DEVICES=$(ls -d /dev/nvidia* /dev/nvidia-caps/* 2>/dev/null); echo " +
				readyMarker + "; exec sleep 86400"},
			Resources: corev1.ResourceRequirements{Limits: limits},
		}},
	}
}

// AddPod writes a static pod manifest. It writes a dotfile first (the kubelet ignores those) and renames it
// into place, so the kubelet never reads a half-written manifest.
func (e *Env) AddPod(spec PodSpec) error {
	b, err := podManifest(spec)
	if err != nil {
		return fmt.Errorf("pod %s: %w", spec.Name, err)
	}
	tmp := filepath.Join(e.d.manifests, "."+spec.Name+".json")
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("pod %s: %w", spec.Name, err)
	}
	if err := os.Rename(tmp, filepath.Join(e.d.manifests, spec.Name+".json")); err != nil {
		return fmt.Errorf("pod %s: %w", spec.Name, err)
	}
	return nil
}

// DeletePod removes a static pod's manifest; the kubelet then kills the pod and forgets it.
func (e *Env) DeletePod(name string) error {
	if err := os.Remove(filepath.Join(e.d.manifests, name+".json")); err != nil {
		return fmt.Errorf("pod %s: %w", name, err)
	}
	return nil
}

// PodName is the name the kubelet gives a static pod: the manifest's name and the node name.
func (e *Env) PodName(name string) string { return name + "-" + e.cfg.NodeName }

// Pods reads the kubelet's /pods endpoint: every pod it knows, with the status it computed. Without an API
// server this is the only place a static pod's admission result (phase, reason, message) is visible.
func (e *Env) Pods(ctx context.Context) ([]corev1.Pod, error) {
	// The kubelet serves its self-signed certificate from --cert-dir; the suite trusts the loopback.
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	url := fmt.Sprintf("https://127.0.0.1:%d/pods", e.kubeletPort)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("kubelet /pods: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("kubelet /pods: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("kubelet /pods: %s: %s", resp.Status, body)
	}
	var list corev1.PodList
	if err := json.Unmarshal(body, &list); err != nil {
		return nil, fmt.Errorf("kubelet /pods: %w", err)
	}
	return list.Items, nil
}

// Pod returns the kubelet's view of one static pod (by manifest name), or nil if it does not know it.
func (e *Env) Pod(ctx context.Context, name string) (*corev1.Pod, error) {
	pods, err := e.Pods(ctx)
	if err != nil {
		return nil, err
	}
	full := e.PodName(name)
	for i := range pods {
		if pods[i].Name == full && pods[i].Namespace == PodNamespace {
			return &pods[i], nil
		}
	}
	return nil, nil
}

// WaitPod polls the kubelet until cond holds for the pod (nil when the kubelet does not know it) and returns
// the pod; on timeout the error shows the pod's last status.
func (e *Env) WaitPod(ctx context.Context, name string, what string, cond func(*corev1.Pod) bool) (*corev1.Pod, error) {
	var last *corev1.Pod
	err := poll(ctx, 250*time.Millisecond, func() error {
		if e.kubelet != nil {
			if done, werr := e.kubelet.Exited(); done {
				return stop(fmt.Errorf("kubelet exited: %v", werr))
			}
		}
		p, err := e.Pod(ctx, name)
		if err != nil {
			return err
		}
		last = p
		if cond(p) {
			return nil
		}
		return fmt.Errorf("not yet %s: %s", what, DescribePod(p))
	})
	if err != nil {
		return last, fmt.Errorf("pod %s: %w", name, err)
	}
	return last, nil
}

// WaitRunning waits until the pod's container runs, and fails fast if the pod ends instead.
func (e *Env) WaitRunning(ctx context.Context, name string) (*corev1.Pod, error) {
	var failed error
	p, err := e.WaitPod(ctx, name, "running", func(p *corev1.Pod) bool {
		if p == nil {
			return false
		}
		if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
			failed = fmt.Errorf("pod %s ended: %s", name, DescribePod(p))
			return true
		}
		return p.Status.Phase == corev1.PodRunning && len(p.Status.ContainerStatuses) == 1 &&
			p.Status.ContainerStatuses[0].State.Running != nil
	})
	if err != nil {
		return p, err
	}
	return p, failed
}

// WaitGone waits until the kubelet no longer lists the pod.
func (e *Env) WaitGone(ctx context.Context, name string) error {
	_, err := e.WaitPod(ctx, name, "gone", func(p *corev1.Pod) bool { return p == nil })
	return err
}

// DescribePod is a one-line summary of a pod's status for error messages.
func DescribePod(p *corev1.Pod) string {
	if p == nil {
		return "<unknown to the kubelet>"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "phase=%s", p.Status.Phase)
	if p.Status.Reason != "" {
		fmt.Fprintf(&b, " reason=%s", p.Status.Reason)
	}
	if p.Status.Message != "" {
		fmt.Fprintf(&b, " message=%q", p.Status.Message)
	}
	for _, cs := range p.Status.ContainerStatuses {
		fmt.Fprintf(&b, " container %s:", cs.Name)
		switch {
		case cs.State.Running != nil:
			b.WriteString(" running")
		case cs.State.Waiting != nil:
			fmt.Fprintf(&b, " waiting %s %q", cs.State.Waiting.Reason, cs.State.Waiting.Message)
		case cs.State.Terminated != nil:
			fmt.Fprintf(&b, " terminated %s (exit %d) %q", cs.State.Terminated.Reason, cs.State.Terminated.ExitCode, cs.State.Terminated.Message)
		}
		fmt.Fprintf(&b, " restarts=%d id=%s", cs.RestartCount, cs.ContainerID)
	}
	return b.String()
}

// ContainerEnv returns the environment the pod's container really started with, as it printed it into its
// log, waiting until the dump is complete.
func (e *Env) ContainerEnv(ctx context.Context, name string) (map[string]string, error) {
	env, err := e.containerEnv(ctx, PodNamespace, e.PodName(name), "*", "main")
	if err != nil {
		return nil, fmt.Errorf("pod %s: container env: %w", name, err)
	}
	return env, nil
}

// containerEnv reads the environment that the container of pod namespace/name (uid may be a glob) printed
// into its log.
func (e *Env) containerEnv(ctx context.Context, namespace, name, uid, container string) (map[string]string, error) {
	// The kubelet names pod log directories namespace_podname_uid/container/N.log.
	pattern := filepath.Join(e.d.podLogs, namespace+"_"+name+"_"+uid, container, "*.log")
	var env map[string]string
	err := poll(ctx, 200*time.Millisecond, func() error {
		files, err := filepath.Glob(pattern)
		if err != nil {
			return stop(err)
		}
		if len(files) != 1 {
			return fmt.Errorf("want one log file matching %s, have %v", pattern, files)
		}
		f, err := os.Open(files[0])
		if err != nil {
			return err
		}
		defer f.Close()
		var done bool
		env, done, err = parseEnvLog(f)
		if err != nil {
			return stop(fmt.Errorf("%s: %w", files[0], err))
		}
		if !done {
			return fmt.Errorf("%s: no %s line yet", files[0], readyMarker)
		}
		return nil
	})
	return env, err
}

// parseEnvLog reads a CRI log file (`TIMESTAMP STREAM TAG MESSAGE` per line, TAG P for a partial line that
// continues, F for the final piece) holding `env` output followed by readyMarker. done reports whether
// readyMarker was seen.
func parseEnvLog(r io.Reader) (env map[string]string, done bool, err error) {
	env = map[string]string{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	var partial strings.Builder
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), " ", 4)
		if len(parts) < 3 {
			return nil, false, fmt.Errorf("malformed CRI log line %q", sc.Text())
		}
		msg := ""
		if len(parts) == 4 {
			msg = parts[3]
		}
		if parts[1] != "stdout" {
			continue
		}
		partial.WriteString(msg)
		if parts[2] == "P" {
			continue
		}
		line := partial.String()
		partial.Reset()
		if line == readyMarker {
			return env, true, nil
		}
		if k, v, ok := strings.Cut(line, "="); ok {
			env[k] = v
		}
	}
	if err := sc.Err(); err != nil {
		return nil, false, err
	}
	return env, false, nil
}

// ContainerID returns the runtime's ID of the pod's container (without the containerd:// prefix).
func ContainerID(p *corev1.Pod) (string, error) {
	if p == nil || len(p.Status.ContainerStatuses) != 1 {
		return "", errors.New("pod has no single container status: " + DescribePod(p))
	}
	id := p.Status.ContainerStatuses[0].ContainerID
	_, raw, ok := strings.Cut(id, "://")
	if !ok || raw == "" {
		return "", fmt.Errorf("pod %s: container ID %q not of the form runtime://id", p.Name, id)
	}
	return raw, nil
}

// ContainerLogTail returns the last n lines of the logs of container in the pods of namespace whose names
// start with prefix (every restart's file), for a failing test to show what a component said.
func (e *Env) ContainerLogTail(namespace, prefix, container string, n int) string {
	files, _ := filepath.Glob(filepath.Join(e.d.podLogs, namespace+"_"+prefix+"*", container, "*.log"))
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			out = append(out, f+": "+err.Error())
			continue
		}
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		out = append(out, "== "+f)
		out = append(out, lines[max(0, len(lines)-n):]...)
	}
	return strings.Join(out, "\n")
}

// ContainerLog returns the messages the container of the API pod p has logged so far, every restart's log in
// order, read from the kubelet's pod log files (CRI format; a partial line's pieces are joined). The API
// server's pods/log would need the kubelet's serving certificate to be trusted; the files are the same text.
func (e *Env) ContainerLog(p *corev1.Pod, container string) (string, error) {
	dir := filepath.Join(e.d.podLogs, p.Namespace+"_"+p.Name+"_"+string(p.UID), container)
	files, err := filepath.Glob(filepath.Join(dir, "*.log"))
	if err != nil {
		return "", err
	}
	if len(files) == 0 {
		return "", fmt.Errorf("pod %s/%s: no log of container %s in %s", p.Namespace, p.Name, container, dir)
	}
	// N.log, N counting restarts from 0.
	slices.SortFunc(files, func(a, b string) int {
		na, _ := strconv.Atoi(strings.TrimSuffix(filepath.Base(a), ".log"))
		nb, _ := strconv.Atoi(strings.TrimSuffix(filepath.Base(b), ".log"))
		return na - nb
	})
	var out strings.Builder
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			return "", err
		}
		for line := range strings.Lines(string(b)) {
			// TIMESTAMP STREAM TAG MESSAGE
			f := strings.SplitN(strings.TrimSuffix(line, "\n"), " ", 4)
			if len(f) < 4 {
				continue
			}
			out.WriteString(f[3])
			if f[2] != "P" {
				out.WriteByte('\n')
			}
		}
	}
	return out.String(), nil
}
