# gpu-agent image: `make image`. Two stages: build with a pinned Go toolchain, run on distroless.
#
# The agent is a cgo binary (go-nvml dlopens libnvidia-ml.so.1), so it needs glibc at run time:
# the builder and the base image are the same Debian release (12, glibc 2.36), which keeps the
# binary's glibc symbol versions available. The image carries no NVIDIA library: the driver's
# libnvidia-ml.so.1 comes from the host, injected by the NVIDIA container toolkit
# (NVIDIA_VISIBLE_DEVICES below) or mounted from the driver root and named with --nvml-lib /
# GPU_AGENT_NVML_LIB (the Helm chart's driver.root).

ARG GO_VERSION=1.26.8

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
# Modules first, so a source change does not re-download them.
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
# The build context has no .git, so the commit comes in as an argument (make image sets both).
ARG COMMIT=unknown
# go-nvml's cgo headers use deprecated declarations; keep the build quiet.
ENV CGO_ENABLED=1 CGO_CFLAGS=-Wno-deprecated-declarations
RUN go build -trimpath -ldflags "-s -w -X main.version=${VERSION} -X main.commit=${COMMIT}" -o /out/gpu-agent ./cmd/gpu-agent \
 && /out/gpu-agent version

FROM gcr.io/distroless/base-debian12
ARG VERSION=dev
LABEL org.opencontainers.image.title="gpu-agent" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/gpu-agent/gpu-agent"
COPY --from=build /out/gpu-agent /usr/bin/gpu-agent
# Read by the NVIDIA container toolkit: all GPUs' device nodes and the utility (NVML) libraries.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
# root: the kubelet's device-plugin and pod-resources directories are root-owned.
USER 0:0
EXPOSE 9400
ENTRYPOINT ["/usr/bin/gpu-agent"]
CMD ["run"]
